"""benchmarks/hybrid_speed.py --quick on tiny shapes, so the script cannot rot: every part runs,
its figures come from runs it made, and speculation at every imposed rate kept plain output."""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_quick_run_reports_every_part(tmp_path, default_model_dir, capsys):
    import hybrid_speed
    threads = torch.get_num_threads()
    try:        # one thread: on a loaded machine a second one waits for a core in every parallel region
        results = hybrid_speed.main(["--quick", "--threads", "1", "--rounds", "1", "--out", str(tmp_path / "r.json")])
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(json.dumps(results))
    assert "(d) speculation" in capsys.readouterr().out
    a = results["plain_decode"]
    assert a["ratio"] == a["decode_tokens_per_s"]["outpace"] / a["decode_tokens_per_s"]["transformers"] > 0
    assert list(results["verify_cost"]["ratio"]) == [1, 2, 3, 4]
    for rows in results["rollback_cost"]["by_batch"].values():
        assert all(rows[k]["snapshots"] > 0 and rows[k]["commit_replay"] > 0 for k in (1, 2, 3, 4))
    for model in ("hybrid", "dense twin"):
        d = results["speculation"][model]
        assert d["identical_to_plain"]
        assert set(d["speedup"]) == {"50%", "70%", "90%"}
        # the oracle's imposed rate, per drafted token: at 90% most drafts are accepted, at 50% fewer
        assert d["imposed_acceptance"]["90%"] > d["imposed_acceptance"]["50%"]
