"""Build the drafter a SpecConfig names."""
from outpace.config import SpecConfig
from outpace.speculative.drafter import Drafter
from outpace.speculative.ngram import NgramDrafter


def make_drafter(spec: SpecConfig) -> Drafter:
    if spec.method == "ngram":
        return NgramDrafter(spec)
    return Drafter()
