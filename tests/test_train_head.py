"""train-head on a tiny target on the CPU: self-distillation, the training-time test, resuming.

Guards: a few steps of training must raise acceptance on held-back prompts above the untrained
head's, both as the trainer measures it and through the engine drafting with the saved head (so
the trainer trains what the drafter drafts, and the head it writes loads); the hidden states and
target logits a batch computes must be the target's own; a fixed seed must give the same head bit for bit, whether the run
was paused and resumed or not; a resumed run with other settings is refused.
"""
import gzip
import json
import shutil

import pytest
import torch

from outpace import LLM, SamplingParams, SpecConfig
from outpace.errors import InvalidParameterError, ModelNotFoundError
from outpace.runner.model_runner import ModelRunner, Row
from outpace.model.eagle3 import default_layers, load_eagle3_head
from outpace.train.answers import Answers
from outpace.train.head_data import Answer, generate_shards, load_shards
from outpace.train.head_trainer import GROUP_BATCHES, TrainConfig, epoch_batches, train_head
from outpace.train.unroll import unrolled_loss
from safetensors.torch import load_file
from tiny import make_tiny

SETTINGS = dict(num_prompts=24, held_out=8, max_tokens=16, draft_vocab=1024, ttt_steps=3, epochs=6, batch_size=8,
                lr=3e-3, warmup_steps=2, eval_every=9, checkpoint_every=9, device="cpu", dtype="float32",
                max_num_seqs=16, shard_size=16)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("train-head")
    make_tiny("llama-4-layers", root / "target", vocab_size=49152, tokenizer_from=default_model_dir)
    with gzip.open(root / "prompts.jsonl.gz", "wt") as f:
        for i in range(40):
            f.write(json.dumps({"id": str(i), "prompt": f"Question {i}: what is {i} plus {3 * i + 1}?"}) + "\n")
    config = TrainConfig(model=str(root / "target"), prompts=str(root / "prompts.jsonl.gz"), out=str(root / "a"),
                         **SETTINGS)
    return root, config, train_head(config)


def test_training_raises_acceptance_on_held_back_prompts(trained):
    root, config, summary = trained
    log = summary["acceptance"]
    assert [e["step"] for e in log] == [0, 9, 18]
    assert log[-1]["mean_accepted"] > log[0]["mean_accepted"] + 0.05
    assert summary["train_sequences"] == 24 and summary["held_out_sequences"] == 8
    # the untrained head: the same run stopped before its first step
    shutil.copytree(root / "a" / "data", root / "untrained" / "data")
    train_head(TrainConfig(**{**vars(config), "out": str(root / "untrained"), "max_steps": 0}))
    held = load_shards(root / "a" / "data", "heldout")
    prompts = [s.tokens[:s.prompt_len].tolist() for s in held]
    accepted = {}
    for name in ("untrained", "a"):
        spec = SpecConfig(method="eagle3", draft_head=str(root / name / "head"), num_draft_tokens=3)
        llm = LLM(str(root / "target"), spec=spec, dtype="float32", device="cpu", max_num_seqs=8, calibrate=False,
                  max_model_len=128)
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
        assert [o.token_ids for o in out] == [s.tokens[s.prompt_len:].tolist() for s in held]   # the answers recorded
        accepted[name] = sum(o.spec["num_accepted_tokens"] for o in out)
    assert accepted["a"] > accepted["untrained"]


def test_a_batchs_features_are_the_targets_own(trained):
    """A batch's answers of different lengths read in one padded forward: each one's hidden states
    at the head's layers and its target logits over the draft vocabulary are the target's for
    that answer alone, and nothing past its end."""
    root, config, _ = trained
    llm = LLM(str(root / "target"), spec="none", dtype="float32", device="cpu", calibrate=False, max_model_len=128)
    target = llm.engine.model
    seqs = load_shards(root / "a" / "data", "train")[:6]
    assert len({len(s.tokens) for s in seqs}) > 1
    ids = torch.arange(0, 2048, 2)
    answers = Answers(target, default_layers(4), ids, 3, "cpu", max(len(s.tokens) for s in seqs), len(seqs))
    assert answers.layers == (0, 1, 3)                  # the head's three layers; the last one for the targets
    batch = answers.batch(seqs)
    runner = ModelRunner(target, 1, 128, 8)
    for b, seq in enumerate(seqs):
        n = len(seq.tokens) - 1
        logits, want = runner.forward([Row(0, seq.tokens[:-1].tolist(), 0)], hidden_layers=answers.layers)
        torch.testing.assert_close(batch.hidden[b, :n], want[0][:, answers.features], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(batch.target_logits[b, :n], logits[0][:, ids], rtol=1e-4, atol=1e-4)
        assert not batch.hidden[b, n:].any()


def test_later_steps_over_the_answers_alone_give_the_whole_unrolls_results(trained):
    """The unrolled steps after the first run only from the batch's first answer token less the
    steps (an index before it predicts no answer token at any later step): loss, gradients,
    accepted runs and ranks equal the unroll over every index, in float64."""
    root, config, _ = trained
    llm = LLM(str(root / "target"), spec="none", dtype="float64", device="cpu", calibrate=False, max_model_len=128)
    target = llm.engine.model
    head = load_eagle3_head(root / "a" / "head", target.cfg, torch.float64, "cpu", 128).train().requires_grad_(True)
    seqs = load_shards(root / "a" / "data", "train")[:6]
    ids = head.to_target(torch.arange(head.cfg.draft_vocab_size))
    answers = Answers(target, head.cfg.target_layers, ids, 3, "cpu", max(len(s.tokens) for s in seqs), len(seqs))
    batch = answers.batch(seqs)
    batch.hidden, batch.target_logits = batch.hidden.double(), batch.target_logits.double()
    assert min(s.prompt_len for s in seqs) - 1 - 3 > 0                   # the later steps are cut
    results, grads = [], []
    for sliced in (True, False):
        head.zero_grad()
        loss, accepted, counted, ranks = unrolled_loss(head, target.embed, batch, 3, answers.in_vocab, top=4,
                                                       sliced=sliced)
        loss.backward()
        results.append((loss.detach(), accepted, counted, ranks))
        grads.append([p.grad.clone() for p in head.parameters() if p.grad is not None])
    (loss, accepted, counted, ranks), whole = results
    torch.testing.assert_close(loss, whole[0], rtol=1e-12, atol=0)
    assert torch.equal(accepted, whole[1]) and torch.equal(ranks, whole[3]) and accepted.any()
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2"])
def test_a_hybrid_targets_batch_features_are_its_own(tmp_path, family):
    """A hybrid target (recurrent layers) reads a batch's answers padded, each row's recurrent
    state starting from zero at position 0: the features equal each answer read alone, so a head
    trains on a hybrid target's own states."""
    from outpace.weights.loader import load_model
    make_tiny(family, tmp_path)
    target = load_model(tmp_path, torch.float32, "cpu", max_len=64)
    g = torch.Generator().manual_seed(0)
    seqs = [Answer(torch.randint(0, 256, (n,), generator=g), 3) for n in (9, 14, 5)]
    answers = Answers(target, default_layers(target.cfg.num_layers), torch.arange(64), 2, "cpu", 14, len(seqs))
    batch = answers.batch(seqs)
    runner = ModelRunner(target, 1, 64, 8)
    for b, seq in enumerate(seqs):
        n = len(seq.tokens) - 1
        _, want = runner.forward([Row(0, seq.tokens[:-1].tolist(), 0)], logits="none", hidden_layers=answers.layers)
        torch.testing.assert_close(batch.hidden[b, :n], want[0][:, answers.features], rtol=1e-4, atol=1e-4)


def test_a_fixed_seed_gives_the_same_head_paused_or_not(trained):
    root, config, summary = trained
    shutil.copytree(root / "a" / "data", root / "b" / "data")
    paused = {**vars(config), "out": str(root / "b")}
    train_head(TrainConfig(**{**paused, "max_steps": 9}))
    assert json.loads((root / "b" / "summary.json").read_text())["steps"] == 9
    resumed = train_head(TrainConfig(**paused))
    assert resumed["steps"] == summary["steps"] == 18
    a, b = load_file(str(root / "a" / "head" / "model.safetensors")), load_file(str(root / "b" / "head" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["acceptance"] == summary["acceptance"]
    with pytest.raises(InvalidParameterError, match="other settings"):
        train_head(TrainConfig(**{**paused, "lr": 1e-3}))


def test_a_head_trains_further_from_a_saved_one(trained):
    """--init-head: the run starts from the saved head (stopped before its first step it writes
    that head back bit for bit, and acceptance starts where the first run ended, not at the
    untrained head's), keeps its draft vocabulary, and its steps change it; a resumed continuation
    must name the same head, and a missing one, or a --draft-vocab that would drop some of its
    ids, is refused before any prompt is answered."""
    root, config, summary = trained
    first = load_file(str(root / "a" / "head" / "model.safetensors"))
    runs = {}
    for name, steps in (("again0", 0), ("again", 3)):
        shutil.copytree(root / "a" / "data", root / name / "data")
        runs[name] = train_head(TrainConfig(**{**vars(config), "out": str(root / name), "init_head": str(root / "a" / "head"),
                                               "draft_vocab": None, "max_steps": steps}))
    start = runs["again0"]["acceptance"][0]["mean_accepted"]
    assert abs(start - summary["acceptance"][-1]["mean_accepted"]) < 0.05
    assert start > summary["acceptance"][0]["mean_accepted"] + 0.05
    kept = load_file(str(root / "again0" / "head" / "model.safetensors"))
    assert kept.keys() == first.keys() and all(torch.equal(kept[k], first[k]) for k in first)
    assert runs["again"]["draft_vocab"] == len(first["d2t"]) == 1024
    trained_further = load_file(str(root / "again" / "head" / "model.safetensors"))
    assert torch.equal(trained_further["d2t"], first["d2t"]) and not torch.equal(trained_further["fc.weight"], first["fc.weight"])
    with pytest.raises(InvalidParameterError, match="other settings"):
        train_head(TrainConfig(**{**vars(config), "out": str(root / "again")}))
    with pytest.raises(ModelNotFoundError, match="no config.json"):     # before any prompt is answered
        train_head(TrainConfig(**{**vars(config), "out": str(root / "nohead"), "init_head": str(root / "missing")}))
    with pytest.raises(InvalidParameterError, match="only widens: give --draft-vocab 1024 or more"):
        train_head(TrainConfig(**{**vars(config), "out": str(root / "nohead"), "init_head": str(root / "a" / "head"),
                                  "draft_vocab": 512}))
    assert not (root / "nohead" / "data").exists()


def test_a_larger_draft_vocab_widens_a_saved_head(trained):
    """--init-head with a larger --draft-vocab: the head keeps its ids and their LM head rows, adds
    the training answers' most frequent ids it lacks, their rows the target's (as a new head's
    start), and its other weights; with --lm-head-int8 the saved LM head is int8 and the summary
    measures that saved head."""
    from outpace.train.answers import lm_head_rows
    from outpace.train.draft_vocab import answer_counts
    root, config, summary = trained
    first = load_file(str(root / "a" / "head" / "model.safetensors"))
    shutil.copytree(root / "a" / "data", root / "wide" / "data")
    wide = train_head(TrainConfig(**{**vars(config), "out": str(root / "wide"), "init_head": str(root / "a" / "head"),
                                     "draft_vocab": 1536, "max_steps": 0, "lm_head_int8": True}))
    assert wide["draft_vocab"] == 1536
    saved = load_file(str(root / "wide" / "head" / "model.safetensors"))
    ids = torch.arange(1536) + saved["d2t"]
    own = torch.arange(1024) + first["d2t"]
    assert torch.equal(ids, ids.sort().values) and torch.isin(own, ids).all()
    # the new ids: the answers' most frequent among those the head lacked
    counts = answer_counts(load_shards(root / "a" / "data", "train"), 49152)
    new = ids[~torch.isin(ids, own)]
    rest = counts.clone()
    rest[own] = -1
    assert counts[new].min() >= rest.topk(len(new)).values.min()
    rows = saved["lm_head.weight"].float() * saved["lm_head.weight_scale"][:, None]
    scale = saved["lm_head.weight_scale"][:, None]
    kept = torch.searchsorted(ids, own)
    assert ((rows[kept] - first["lm_head.weight"].float()).abs() <= scale[kept] / 2 + 1e-6).all()
    target = LLM(str(root / "target"), spec="none", dtype="float32", device="cpu", calibrate=False).engine.model
    fresh = torch.searchsorted(ids, new)
    assert ((rows[fresh] - lm_head_rows(target, new).float()).abs() <= scale[fresh] / 2 + 1e-6).all()
    for name in ("fc.weight", "midlayer.mlp.down_proj.weight", "norm.weight"):
        assert torch.equal(saved[name], first[name]), name
    assert wide["saved_head_mean_accepted"] > 0
    # the engine drafts with the int8 head, and greedy output stays the target's
    prompts = [s.tokens[:s.prompt_len].tolist() for s in load_shards(root / "a" / "data", "heldout")][:4]
    spec = SpecConfig(method="eagle3", draft_head=str(root / "wide" / "head"), num_draft_tokens=3)
    llm = LLM(str(root / "target"), spec=spec, dtype="float32", device="cpu", max_num_seqs=4, calibrate=False,
              max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=16)
    drafted = llm.generate(prompts, params)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in llm.generate(prompts, params, speculate=False)]
    assert sum(o.spec["num_draft_tokens"] for o in drafted) > 0


def test_the_target_writes_its_own_prompts(tmp_path, default_model_dir):
    """--self-prompts: the default model, opened at a user turn of its chat template, writes
    distinct finished prompts; the same seed gives the same ones, and a rerun reads them back from
    the output folder rather than sampling again."""
    from outpace.train.self_prompts import self_prompts, user_turn_prefix
    llm = LLM(str(default_model_dir), spec="none", device="cpu", max_num_seqs=8, calibrate=False, max_model_len=256)
    prefix = llm.tokenizer.decode(user_turn_prefix(llm.tokenizer), skip_special_tokens=False)
    assert prefix.endswith("<|im_start|>user\n")
    first = self_prompts(llm, 6, seed=1, path=tmp_path / "a.jsonl")
    assert len(first) == len(set(first)) == 6 and all(p and p == p.strip() for p in first)
    assert all("<|im_end|>" not in p for p in first)
    assert self_prompts(llm, 6, seed=1, path=tmp_path / "b.jsonl") == first
    assert self_prompts(llm, 6, seed=2, path=tmp_path / "c.jsonl") != first
    lines = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    lines[0]["prompt"] = "kept from the file"       # edited as JSON: a prompt's quotes are escaped there
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert self_prompts(llm, 6, seed=1, path=tmp_path / "a.jsonl")[0] == "kept from the file"


def test_file_prompts_draws_that_many_of_the_file(trained):
    """--file-prompts N answers N of the file's prompts (drawn with the seed), the rest of the
    mix coming from --self-prompts: of the file's 40, 20 are drawn, 8 held back, 12 trained on."""
    root, config, _ = trained
    summary = train_head(TrainConfig(**{**vars(config), "out": str(root / "drawn"), "file_prompts": 20,
                                        "max_steps": 0}))
    assert summary["held_out_sequences"] == 8 and summary["train_sequences"] == 12
    held = load_shards(root / "drawn" / "data", "heldout")
    train = load_shards(root / "drawn" / "data", "train")
    assert len({tuple(s.tokens[:s.prompt_len].tolist()) for s in held + train}) == 20


def test_task_prompts_from_the_training_answers_train_too(trained):
    """--task-prompts: prompts built from the run's training answers are answered after them and
    trained on with them (held-back prompts unchanged); each task answer's context holds a
    training answer's text or question, and a rerun finds its shards rather than answering again."""
    root, config, _ = trained
    settings = {**vars(config), "out": str(root / "tasks"), "num_prompts": 8, "held_out": 4, "max_tokens": 64,
                "max_prompt_tokens": 1024, "task_prompts": 6, "max_steps": 0}
    summary = train_head(TrainConfig(**settings))
    train = load_shards(root / "tasks" / "data", "train")
    tasks = load_shards(root / "tasks" / "data", "task")
    assert summary["task_sequences"] == len(tasks) >= 6 and summary["train_sequences"] == len(train) + len(tasks)
    assert summary["held_out_sequences"] == 4
    llm = LLM(str(root / "target"), spec="none", device="cpu", dtype="float32", calibrate=False, max_model_len=1100)
    decode = llm.tokenizer.decode
    material = [decode(a.tokens[a.prompt_len:].tolist()).strip() for a in train]
    material += [decode(a.tokens[:a.prompt_len].tolist(), skip_special_tokens=False).split("user\n")[-1]
                 .split("<|im_end|>")[0] for a in train]                  # the questions
    for task in tasks:
        context = decode(task.tokens[:task.prompt_len].tolist(), skip_special_tokens=False)
        assert any(m and m[:40] in context for m in material)
    assert summary["task_prompts_answered"] == 6
    before = sorted(p.stat().st_mtime_ns for p in (root / "tasks" / "data").glob("task-*.pt"))
    assert train_head(TrainConfig(**settings))["task_sequences"] == len(tasks)
    assert sorted(p.stat().st_mtime_ns for p in (root / "tasks" / "data").glob("task-*.pt")) == before
    # a limit the longer task prompts are over: those are skipped, said and counted
    shutil.copytree(root / "tasks" / "data", root / "short" / "data", ignore=shutil.ignore_patterns("task-*"))
    longest = max(t.prompt_len for t in tasks if t.turn == 0)
    short = train_head(TrainConfig(**{**settings, "out": str(root / "short"), "max_prompt_tokens": longest - 1}))
    assert 0 < short["task_prompts_answered"] < 6


def test_shards_hold_tensors_and_older_shards_of_lists_still_load(trained, tmp_path):
    root, _, _ = trained
    answers = load_shards(root / "a" / "data", "train")
    shard = torch.load(sorted((root / "a" / "data").glob("train-*.pt"))[0], weights_only=True)
    assert shard["tokens"].dtype == torch.int32 and int(shard["lengths"].sum()) == len(shard["tokens"])
    first = answers[:len(shard["lengths"])]
    torch.save({"tokens": [a.tokens.tolist() for a in first], "prompt_lens": [a.prompt_len for a in first]},
               tmp_path / "old-00000.pt")
    old = load_shards(tmp_path, "old")
    assert [(a.tokens.tolist(), a.prompt_len, a.source, a.turn) for a in old] == \
        [(a.tokens.tolist(), a.prompt_len, 0, 0) for a in first]


def test_an_epochs_batches_hold_every_sequence_once_with_like_lengths():
    """epoch_batches: every sequence once an epoch, each batch's lengths from a sorted run of its
    group (so a batch's padding is what its group's spread leaves), the same order for the same
    (seed, epoch) and another for another epoch."""
    lengths = torch.randint(20, 800, (3 * 8 * GROUP_BATCHES + 5,), generator=torch.Generator().manual_seed(0)).tolist()
    batches = epoch_batches(lengths, 8, seed=3, epoch=0)
    assert sorted(j for b in batches for j in b) == list(range(len(lengths)))
    assert len(batches) == -(-len(lengths) // 8) and sorted(map(len, batches))[1:] == [8] * (len(batches) - 1)
    padded = sum(len(b) * max(lengths[j] for j in b) for b in batches)
    assert padded < 1.1 * sum(lengths)                     # random batches of 8 here: about 1.6x
    assert epoch_batches(lengths, 8, seed=3, epoch=0) == batches != epoch_batches(lengths, 8, seed=3, epoch=1)


def test_a_conversations_turns_are_answered_with_the_answers_before_them(trained):
    """A prompt given as a list of user turns: each turn is answered with the conversation so far
    (the target's own earlier answers) as its context, each answer kept with its source and
    turn; a turn whose context is over max_prompt_tokens is skipped with the rest of its
    conversation."""
    root, config, _ = trained
    llm = LLM(str(root / "target"), spec="none", device="cpu", dtype="float32", max_num_seqs=4, calibrate=False,
              max_model_len=512)
    prompts = ["What is 2 plus 2?", ["Name a colour.", "And another one?"], ["x " * 100, "never asked"]]
    generate_shards(llm, prompts, root / "conversations", "c", 8, 120, 8)
    answers = load_shards(root / "conversations", "c")
    assert [(a.source, a.turn) for a in answers] == [(0, 0), (1, 0), (1, 1)]
    first, second = answers[1], answers[2]
    params = SamplingParams(temperature=0, max_tokens=8)
    text = llm.generate([first.tokens[:first.prompt_len].tolist()], params, speculate=False)[0].text
    context = llm.tokenizer.encode_chat([{"role": "user", "content": "Name a colour."},
                                         {"role": "assistant", "content": text},
                                         {"role": "user", "content": "And another one?"}])
    assert second.tokens[:second.prompt_len].tolist() == context
    assert second.tokens[second.prompt_len:].tolist() == llm.generate([context], params, speculate=False)[0].token_ids


def test_no_prompts_is_refused():
    with pytest.raises(InvalidParameterError, match="no prompts"):
        TrainConfig(model="smollm2-135m", prompts=None, out="x")
