"""Every script in examples/ runs for a few steps, as a user launches it (torchrun, 2 ranks).

Each example prints `step N loss X` on rank 0; a run passes when it exits 0 within its
timeout, its losses are finite and fall, and it prints no third-party warning or notice. Each
is then cut back to its step-2 checkpoint and started again: it must resume by itself and end
bitwise equal to its uninterrupted run. A hang kills the whole process group and shows the
output so far.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from helpers.quiet import assert_quiet

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT = 300  # seconds per launch; 20-45 s each on 2 busy cores
STEP = re.compile(r"^step (\d+) loss (\S+)", re.MULTILINE)


def run_example(script: str, *args: str, cwd: Path, nproc: int = 2) -> str:
    """Run examples/`script` (under torchrun when `nproc` > 1); its output, after checking it exited 0."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command = (launcher if nproc > 1 else [sys.executable]) + [str(EXAMPLES / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # a parent torchrun's
        env.pop(name, None)
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and its ranks
        output, _ = process.communicate()
        pytest.fail(f"{script} {' '.join(args)} did not finish in {TIMEOUT} s:\n{output[-4000:]}")
    assert process.returncode == 0, f"{script} {' '.join(args)} exited {process.returncode}:\n{output[-4000:]}"
    return output


def losses(output: str) -> dict[int, float]:
    """`step N loss X` lines -> {N: X}."""
    return {int(step): float(loss) for step, loss in STEP.findall(output)}


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every .safetensors file under `folder`, by file and name."""
    return {f"{file.relative_to(folder)}:{name}": value for file in sorted(folder.rglob("*.safetensors"))
            for name, value in safetensors.torch.load_file(file).items()}


def assert_resumes_exactly(script: str, args: list[str], out: Path, cut: list[str], final: str,
                           first: str, resumed_line: str) -> None:
    """Cut `out` back to its step-2 checkpoint (delete `cut`), start the same command again: it must say
    `resumed_line`, log steps 3 and 4 as the uninterrupted run `first` did, and write `final` with
    every tensor bitwise equal to the uninterrupted run's."""
    expected = tensors(out / final)
    assert expected, f"nothing to compare in {out / final}"
    for name in cut:
        shutil.rmtree(out / name)
    output = run_example(script, *args, cwd=out.parent)
    assert resumed_line in output, output[-2000:]
    assert_quiet(output)
    again = {step: loss for step, loss in STEP.findall(output)}
    assert sorted(again) == ["3", "4"], output[-2000:]
    got = tensors(out / final)
    assert got.keys() == expected.keys()
    different = [name for name in expected if not torch.equal(expected[name], got[name])]
    assert again == {step: loss for step, loss in STEP.findall(first) if step in again}, (again, first)
    assert different == [], f"resumed at step 2, these differ from the uninterrupted run: {different[:5]}"


# The bitwise resume from step 2 under make test-all only: make test checks it on the same loop (`fit`, which
# examples/hf_finetune_pretrained.py imports from hf_causal_lm.py), zero3 at 2 ranks, in
# test_hf_finetune_pretrained_loads_trains_resumes_and_exports; a launch of torchrun less here.
@pytest.mark.parametrize("resume_bitwise", [pytest.param(True, marks=pytest.mark.slow), False])
def test_hf_causal_lm_trains_saves_and_resumes(tmp_path, resume_bitwise):
    """Catches the example going stale against the API (it must run as a user copies it), a loss
    that does not fall or turns non-finite under zero3 at 2 ranks, checkpoints not written, a
    third-party warning in its output, a resume from step 2 that does not end bitwise equal to the
    uninterrupted run (`resume_bitwise`), and a resume that does not pick up the newest checkpoint: the last
    launch, at world size 1, must continue from step 4 of the 2-rank run (any world size loads any checkpoint)."""
    out = tmp_path / "run"
    args = ["--max-steps", "4", "--save-every", "2", "--batch", "4", "--seq", "64", "--out", str(out)]
    output = run_example("hf_causal_lm.py", *args, cwd=tmp_path)
    assert_quiet(output)
    first = losses(output)
    assert sorted(first) == [1, 2, 3, 4], first
    assert all(math.isfinite(x) for x in first.values()) and first[4] < first[1], first
    assert sorted(p.name for p in out.iterdir()) == ["hf", "step-000002", "step-000004"]
    assert {"config.json", "model.safetensors"} <= {p.name for p in (out / "hf").iterdir()}
    if resume_bitwise:
        assert_resumes_exactly("hf_causal_lm.py", args, out, ["step-000004", "hf"], "hf", output,
                               "resumed from")

    output = run_example("hf_causal_lm.py", "--max-steps", "6", "--batch", "4", "--seq", "64", "--out", str(out),
                         cwd=tmp_path, nproc=1)
    assert re.search(r"resumed from .*step-000004 at step 4", output), output[-2000:]
    resumed = losses(output)
    assert sorted(resumed) == [5, 6] and all(math.isfinite(x) for x in resumed.values()), resumed
    assert sorted(p.name for p in out.iterdir()) == ["hf", "step-000004", "step-000006"]  # keep_last=2


def test_hf_finetune_pretrained_loads_trains_resumes_and_exports(tmp_path):
    """Catches the pretrained fine-tuning example going stale: sw.from_pretrained of a directory that
    save_pretrained wrote in several files not loading into zero3 at 2 ranks, a loss that does not fall,
    a resume from step 2 that does not end bitwise equal (the checkpoint's values must replace the
    pretrained ones), an export that is one file past --shard-size or that from_pretrained does not load
    equal, and a third-party line in its output (save_pretrained's progress bars)."""
    import transformers

    out, pretrained = tmp_path / "run", tmp_path / "pretrained"
    args = ["--max-steps", "4", "--save-every", "2", "--batch", "4", "--seq", "64", "--out", str(out),
            "--pretrained", str(pretrained)]
    output = run_example("hf_finetune_pretrained.py", *args, cwd=tmp_path)
    assert_quiet(output)
    assert_trained(output, 4)
    assert len(list(pretrained.glob("model-*.safetensors"))) >= 3
    exported = sorted(p.name for p in (out / "hf").iterdir())
    assert "model.safetensors.index.json" in exported and len([n for n in exported if n.startswith("model-")]) >= 3
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out / "hf").state_dict()
    saved = {name.split(":")[1]: value for name, value in tensors(out / "hf").items()}
    assert all(torch.equal(loaded[name], value) for name, value in saved.items()) and len(saved) >= 20
    assert_resumes_exactly("hf_finetune_pretrained.py", args, out, ["step-000004", "hf"], "hf", output,
                           "resumed from")


def assert_trained(output: str, steps: int) -> None:
    """Rank 0 logged steps 1..`steps` once each, every loss finite, the last below the first."""
    logged = losses(output)
    assert sorted(logged) == list(range(1, steps + 1)) and len(STEP.findall(output)) == steps, output[-2000:]
    assert all(math.isfinite(x) for x in logged.values()) and logged[steps] < logged[1], logged


@pytest.mark.slow  # 100 s of launches; make test runs the Trainer in tests/test_trainer.py (training, resume) in-pool
def test_hf_trainer_trains_and_saves_its_checkpoints(tmp_path):
    """Catches the Trainer example going stale (ShardwiseTrainer, TrainingArguments of the pinned
    transformers), its loss not falling at 2 ranks with gradient accumulation, the Trainer's
    own checkpoints (save_strategy="steps") not written (each holds the whole model and, in
    shardwise/, every rank's optimizer rows), DeepSpeed's, transformers' or the Trainer's own
    lines in the output, and a restart that needs --resume or does not end bitwise equal."""
    out = tmp_path / "trainer"
    args = ["--max-steps", "4", "--save-every", "2", "--batch", "2", "--seq", "64", "--out", str(out)]
    output = run_example("hf_trainer.py", *args, cwd=tmp_path)
    assert_trained(output, 4)
    assert_quiet(output)
    assert (out / "final" / "model.safetensors").is_file()
    for step in (2, 4):
        assert (out / f"checkpoint-{step}" / "model.safetensors").is_file(), sorted(out.iterdir())
        assert (out / f"checkpoint-{step}" / "shardwise" / "index.json").is_file()
    assert_resumes_exactly("hf_trainer.py", args, out, ["checkpoint-4", "final"], "final", output,
                           "resuming from")


@pytest.mark.slow  # make test runs ShardwiseAccelerator in tests/test_accelerate.py (loop, save_state resume) in-pool
def test_accelerate_lm_trains_and_saves(tmp_path):
    """Catches the Accelerate example going stale (ShardwiseAccelerator against the pinned accelerate),
    Accelerate not seeing torchrun's 2 ranks (the script exits non-zero then), its loss not falling
    with accumulation and clipping, sw.save / save_model not writing, Accelerate's or transformers'
    warnings in the output, and a restart that does not resume by itself, bitwise equal."""
    out = tmp_path / "acc"
    args = ["--max-steps", "4", "--save-every", "2", "--batch", "2", "--seq", "64", "--out", str(out)]
    output = run_example("accelerate_lm.py", *args, cwd=tmp_path)
    assert_trained(output, 4)
    assert_quiet(output)
    assert sorted(p.name for p in out.iterdir()) == ["final", "step-000002", "step-000004"]
    assert (out / "step-000004" / "rank-00001-of-00002.safetensors").is_file()
    assert (out / "final" / "model.safetensors").is_file()
    assert_resumes_exactly("accelerate_lm.py", args, out, ["step-000004", "final"], "final", output,
                           "resumed from")


@pytest.mark.slow  # 24 s; make test runs Lightning through test_lightning.py and docs/migrate/lightning.md's block
def test_lightning_lm_trains_and_checkpoints(tmp_path):
    """Catches the Lightning example going stale (ShardwiseStrategy against the pinned lightning),
    its loss not falling with gradient_clip_val and accumulate_grad_batches at 2 ranks,
    ModelCheckpoint not writing shardwise checkpoint directories with Lightning's state beside,
    Lightning's tips, banners and deprecations in the output, and a restart from step 2 that
    does not end bitwise equal: a loader Lightning cannot resume starts its epoch again, a shuffle
    Lightning wraps in its DistributedSamplerWrapper draws a new order on resume, and a loader
    without its own generator draws its seed from the global RNG after the RNG is restored."""
    out = tmp_path / "lit"
    args = ["--max-steps", "4", "--save-every", "2", "--batch", "2", "--seq", "64", "--out", str(out)]
    output = run_example("lightning_lm.py", *args, cwd=tmp_path)
    assert_trained(output, 4)
    assert_quiet(output)
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"], saved
    for name in saved:
        assert {"index.json", "rank-00001-of-00002.safetensors"} <= \
            {p.name for p in (out / "checkpoints" / name).iterdir()}
    assert_resumes_exactly("lightning_lm.py", args, out, ["checkpoints/epoch=0-step=4.ckpt"],
                           "checkpoints/epoch=0-step=4.ckpt", output, "resuming from")


def test_every_example_is_tested():
    """Catches an example added to examples/ that CI never runs."""
    tested = set(re.findall(r'run_example\("([\w.]+)"', Path(__file__).read_text()))
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested
