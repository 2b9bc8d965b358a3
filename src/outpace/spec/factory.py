"""Build the drafter a SpecConfig names."""
from outpace.config import SpecConfig
from outpace.spec.drafter import Drafter
from outpace.spec.ngram import NgramDrafter


def make_drafter(spec: SpecConfig) -> Drafter:
    if spec.method == "ngram":
        return NgramDrafter(spec)
    return Drafter()
