"""Faults of the machine, not of the user: each is one line naming the path and the fix, nothing is left
half-written, and what was on disk before (the user's files, earlier checkpoints) is as it was.

The disk cases use what the kernel really does: a small tmpfs for a full and a read-only disk,
RLIMIT_FSIZE for a file-size limit, the immutable attribute (or, without root, the file mode) for a
directory the run may not write. A lost network mount cannot be made here, so the errno a stale NFS
handle gives is raised from inside the checkpoint writer.
"""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_reliability import checksums

from ftctl.cli import main


def train_args(tiny_model_dir, out, *extra):
    return ["train", "recipe=tiny_lora", f"model.name_or_path={tiny_model_dir}", f"output_dir={out}", "precision=fp32",
            "train.progress_bar=false", "train.num_threads=1", "train.max_steps=2", *extra]


PROGRESS_BAR = re.compile(r"^[^|]*: +\d+%\|")  # transformers' "Loading weights" bar, not a message


def one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not PROGRESS_BAR.match(line)]
    assert len(err) == 1 and err[0].startswith("ftctl: error: "), err
    return err[0]


def whole_metric_lines(run_dir: Path) -> list:
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    return [json.loads(line)["step"] for line in text.splitlines() if "loss" in json.loads(line)]


def stopped_after_its_first_checkpoint(tiny_model_dir, out, capsys, *extra) -> dict:
    """A 2-step run whose result was never written (killed after its step-2 checkpoint); the checkpoint's checksums."""
    assert main(train_args(tiny_model_dir, out, *extra)) == 0, capsys.readouterr().err
    capsys.readouterr()
    shutil.rmtree(out / "final")
    return checksums(out / "checkpoints")


def no_partial_checkpoint(run_dir: Path) -> bool:
    return not [p.name for p in (run_dir / "checkpoints").iterdir() if p.name not in ("step-2",)]


@pytest.fixture
def small_disk(tmp_path):
    """mount(size) makes tmp_path/disk a tmpfs of that size; unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = []

    def mount(size: str) -> Path:
        if os.geteuid() != 0 or not shutil.which("mount"):
            pytest.skip("needs a small tmpfs: mounting one takes root (CAP_SYS_ADMIN)")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "ftctl-test", str(disk)], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"needs a small tmpfs: mount refused ({done.stderr.strip()})")
        mounted.append(disk)
        return disk

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(disk: Path, leave: int) -> Path:
    """A file taking all the free space of ``disk`` but ``leave`` bytes."""
    filler = disk / "filler"
    stats = os.statvfs(disk)
    free = stats.f_bavail * stats.f_frsize + (filler.stat().st_size if filler.exists() else 0)
    filler.write_bytes(b"\0" * max(0, free - leave))
    return filler


def test_a_full_disk_is_one_line_and_loses_nothing(small_disk, tiny_model_dir, capsys):
    disk = small_disk("1m")
    (disk / "notes.txt").write_text("the user's")
    mine = checksums(disk)
    # A first checkpoint that does not fit: cut off while writing, removed, one line.
    fill(disk, leave=120_000)
    assert main(train_args(tiny_model_dir, disk / "a")) == 1
    line = one_error_line(capsys)
    assert re.match(rf"ftctl: error: no space left on the device of {disk / 'a' / 'checkpoints' / 'step-2'}: checkpoint step-2 "
                    r"needs about [\d.]+ KiB, [\d.]+ KiB free; free some space", line), line
    assert not (disk / "a" / "checkpoints").exists() and not (disk / "a" / "final").exists()
    assert whole_metric_lines(disk / "a") == [1, 2]
    # An earlier checkpoint, then a full disk: the next one is refused before a byte is written.
    (disk / "filler").unlink()
    kept = stopped_after_its_first_checkpoint(tiny_model_dir, disk / "b", capsys)
    fill(disk, leave=100_000)
    assert main(train_args(tiny_model_dir, disk / "b", "train.max_steps=4", "resume=auto")) == 1
    line = one_error_line(capsys)
    needed = sum(json.loads((disk / "b" / "checkpoints" / "step-2" / "trainer_state.json").read_text())["files"].values())
    assert re.match(rf"ftctl: error: no space left on the device of .*step-4: checkpoint step-4 needs about {needed / 1024:.1f} KiB, "
                    r"[\d.]+ KiB free", line), line
    assert checksums(disk / "b" / "checkpoints") == kept and no_partial_checkpoint(disk / "b")
    assert whole_metric_lines(disk / "b") == [1, 2, 3, 4]
    assert {k: v for k, v in checksums(disk).items() if k in mine} == mine


def test_a_file_size_limit_is_one_line_and_loses_nothing(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    kept = stopped_after_its_first_checkpoint(tiny_model_dir, out, capsys, "train.report_to=[]")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    # The optimizer state (155 KB, torch.save, which names no errno) is larger; the adapter (69 KB) and the logs are not.
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        code = main(train_args(tiny_model_dir, out, "train.max_steps=4", "train.report_to=[]", "resume=auto"))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert code == 1
    line = one_error_line(capsys)
    assert re.match(rf"ftctl: error: {out / 'checkpoints' / 'step-4'}: a file of checkpoint step-4 exceeds the file-size limit, "
                    r"97\.7 KiB \(100000 bytes\); .* raise it \(`ulimit -f unlimited`\)", line), line
    assert checksums(out / "checkpoints") == kept and no_partial_checkpoint(out)
    assert whole_metric_lines(out) == [1, 2, 3, 4]


def test_a_read_only_run_dir_is_one_line_and_untouched(small_disk, tiny_model_dir, capsys):
    disk = small_disk("2m")
    stopped_after_its_first_checkpoint(tiny_model_dir, disk / "run", capsys)
    before = checksums(disk)
    done = subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"needs a remount read-only: {done.stderr.strip()}")
    assert main(train_args(tiny_model_dir, disk / "run", "train.max_steps=4", "resume=auto")) == 1
    assert one_error_line(capsys) == (f"ftctl: error: output_dir={disk / 'run'}: cannot write in {disk} (it is on a read-only "
                                      "file system; remount it read-write or choose another)")
    assert checksums(disk) == before


def test_a_run_dir_it_may_not_write_is_one_line_and_untouched(small_disk, tiny_model_dir, tmp_path, capsys):
    if os.geteuid() == 0:  # root writes whatever the mode says: the immutable attribute stops even root
        if not shutil.which("chattr"):
            pytest.skip("as root, needs chattr (e2fsprogs) to make a directory unwritable")
        disk = small_disk("2m")
        out = disk / "run"
    else:
        out = tmp_path / "run"
    kept = stopped_after_its_first_checkpoint(tiny_model_dir, out, capsys)
    before = {k: v for k, v in checksums(out).items() if not k.startswith(".ftctl")}
    if os.geteuid() == 0:
        done = subprocess.run(["chattr", "+i", str(out)], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"as root, needs the immutable attribute: {done.stderr.strip()}")
        undo = ["chattr", "-i", str(out)]
    else:
        out.chmod(0o555)
        undo = ["chmod", "755", str(out)]
    try:
        assert main(train_args(tiny_model_dir, out, "train.max_steps=4", "resume=auto")) == 1
    finally:
        subprocess.run(undo, check=True)
    assert re.match(rf"ftctl: error: {out}: permission denied writing the run dir; choose a directory you can write to",
                    one_error_line(capsys))
    assert {k: v for k, v in checksums(out).items() if not k.startswith(".ftctl")} == before
    assert checksums(out / "checkpoints") == kept


def test_a_lost_network_mount_is_one_line_and_loses_nothing(tiny_model_dir, tmp_path, capsys, monkeypatch):
    import torch

    out = tmp_path / "run"
    kept = stopped_after_its_first_checkpoint(tiny_model_dir, out, capsys, "train.report_to=[]")
    real_save = torch.save

    def stale(obj, f, *args, **kwargs):  # what NFS answers once its server is gone
        if "optimizer" in str(f):
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", stale)
    assert main(train_args(tiny_model_dir, out, "train.max_steps=4", "train.report_to=[]", "resume=auto")) == 1
    assert one_error_line(capsys) == (
        f"ftctl: error: {out / 'checkpoints' / 'step-4'}: the file system is gone (Stale file handle; a network mount lost?) "
        "while handling checkpoint step-4; remount it, then continue with resume=auto: checkpoints written before are unaffected")
    assert checksums(out / "checkpoints") == kept and no_partial_checkpoint(out)


MEMORY_PROBE = r"""
import json, resource, sys
from pathlib import Path
from ftctl.config.schema import DataConfig
from ftctl.data.dataset import load_or_tokenize
from transformers import AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
small, big, cache = Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
load_or_tokenize(str(small), DataConfig(format="alpaca", path=str(small), cache_dir=cache), tokenizer)  # warm up


def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


# A run away from the limit must fail, not take the machine's memory: 2 GiB of address space more at most.
resource.setrlimit(resource.RLIMIT_AS, (status("VmSize") * 1024 + (2 << 30), resource.RLIM_INFINITY))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS (VmHWM) starts again from the current RSS
before = status("VmRSS")
data = load_or_tokenize(str(big), DataConfig(format="alpaca", path=str(big), cache_dir=cache), tokenizer)
print(json.dumps({"grew_kib": status("VmHWM") - before, "examples": len(data), "stats": data.stats}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's /proc/self/clear_refs to reset the peak RSS")
def test_one_50_mb_line_is_skipped_in_bounded_memory(tiny_model_dir, tmp_path):
    record = {"instruction": "Say hi", "output": "hi"}
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps(record) + "\n")
    big = tmp_path / "big.jsonl"
    with open(big, "w") as f:
        f.write(json.dumps(record) + "\n")
        f.write('{"instruction": "' + "x" * (50 << 20) + '", "output": "y"}\n')
        f.write(json.dumps({"instruction": "Say bye", "output": "bye"}) + "\n")
    probe = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tiny_model_dir), str(small), str(big), str(tmp_path / "cache")],
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    assert result["examples"] == 2 and result["stats"]["skipped_too_long"] == 1
    assert f"{big}:2, {(50 << 20) + 34} bytes" in result["stats"]["skipped_note"]
    print(f"peak RSS grew by {result['grew_kib']} KiB tokenizing a file with one 50 MiB line")
    # The line is 50 MiB; reading it whole would take that much and more, tokenizing it ~190 bytes a byte.
    assert result["grew_kib"] < 12 * 1024, f"peak RSS grew by {result['grew_kib']} KiB"
