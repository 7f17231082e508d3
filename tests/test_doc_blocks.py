"""Every Python block of README.md and docs/ runs as a reader would run it, and prints what the page shows.

How a block runs (one process, torchrun ranks, after the block before it, with setup for the
reader's own objects) is said by a comment above it: see tests/helpers/doc_blocks.py. The
one-process sessions run one after another in one child process; each torchrun session is a
launch of its own.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from helpers import doc_blocks
from helpers.launch import run
from helpers.quiet import assert_no_warning

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "tests" / "scripts" / "doc_sessions.py"
SESSIONS = doc_blocks.sessions()
# A `slow=` session (its launch of its own) under `make test-all` only.
SESSION_PARAMS = [pytest.param(s, id=s.name, marks=[pytest.mark.slow] if s.slow else []) for s in SESSIONS]
LAUNCH_PARAMS = [pytest.param(key, id=f"{key[0]}-{key[1] or 'shared'}",
                              marks=[pytest.mark.slow] if any(s.slow for s in SESSIONS if s.launch == key) else [])
                 for key in sorted({s.launch for s in SESSIONS})]
RUNNER_END = "\x00doctest-block-end"  # printed after each block: splits a session's output by block
SESSION_START = "\x00doctest-session "  # the runner's line before each session: splits a launch's output
TIMEOUT = 600  # seconds for all sessions of one world size together


def write_script(session: doc_blocks.Session, folder: Path) -> Path:
    """The session as the file a reader would save: its blocks in order, each after its setup."""
    folder.mkdir(parents=True)
    parts = []
    for block in session.blocks:
        parts += [f"# ---- {block.name}\n", block.setup.strip("\n") + "\n", block.code,
                  f"print({RUNNER_END!r}, flush=True)\n"]
    script = folder / "session.py"
    script.write_text("".join(parts))
    return script


def child_env() -> dict:
    # Unbuffered: what a library prints lands between the runner's session lines, in the session that printed it.
    # helpers/launch.py puts src/ on PYTHONPATH for every launch.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def communicate(command: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    """Run `command`; past `timeout` kill all of it, torchrun's ranks too (they run in sessions of their own,
    so killing the agent's group would leave them holding a pipe), and print each rank's stacks."""
    launch = run(command, cwd / "launch.log", timeout, env=child_env(), cwd=cwd)
    output = launch.log.read_text(errors="replace")
    if launch.timed_out:
        return -1, output + f"\n(killed after {timeout} s; still there: {', '.join(launch.hung)})"
    return launch.returncodes[0], output


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Runs the sessions of one launch (Session.launch: one world size) together, the first time a
    test asks for one of them: {launch: ({session name: {"printed", "error", "seconds"} of rank 0, and other ranks'
    errors}, the launch's output, {session name: script})}."""
    base, done = tmp_path_factory.mktemp("docs"), {}

    def launch(key: tuple[int, str]):
        world_size = key[0]
        if key not in done:
            folder = base / f"launch{len(done)}"
            chosen = [s for s in SESSIONS if s.launch == key]
            scripts = {s.name: str(write_script(s, folder / f"s{i}")) for i, s in enumerate(chosen)}
            (folder / "sessions.json").write_text(json.dumps(scripts))
            runner = [str(RUNNER), "sessions.json", "results.json"]
            if world_size:
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={world_size}", "--local-ranks-filter=0", *runner]
            else:
                command = [sys.executable, *runner]
            code, output = communicate(command, folder, TIMEOUT)
            results = {}
            for rank in range(max(world_size, 1)):
                file = folder / ("results.json" + (f".{rank}" if rank else ""))
                for name, result in (json.loads(file.read_text()) if file.exists() else {}).items():
                    results.setdefault(name, result)
                    if result["error"] and not results[name]["error"]:
                        results[name]["error"] = f"rank {rank}:\n{result['error']}"
            done[key] = results, output, scripts
        return done[key]

    return launch


def session_output(output: str, name: str) -> str:
    """What the launch printed while session `name` ran (the launch's start counts as its first session's)."""
    parts = output.split(SESSION_START)
    first = parts[1].split("\n", 1)[0] if len(parts) > 1 else None
    mine = [part.split("\n", 1)[-1] for part in parts[1:] if part.split("\n", 1)[0] == name]
    return "".join(([parts[0]] if name == first else []) + mine)


def check_printed(session: doc_blocks.Session, printed: list[str]) -> None:
    for block, out in zip(session.blocks, printed):
        if block.expected is not None:
            assert doc_blocks.output_matches(block.expected, out), (
                f"{block.name} prints\n{out}\nbut the page shows\n{block.expected}")


@pytest.mark.parametrize("session", SESSION_PARAMS)
def test_doc_block_runs_and_prints_what_the_page_shows(session, launches):
    """Catches a block of README.md or docs/ that no longer runs as written (a missing import, a
    renamed argument, a name the page never defines) or that prints other than the output the
    page shows under it (a logged loss off by the accumulation factor, a changed table)."""
    results, output, scripts = launches(session.launch)
    assert session.name in results, f"the launch never reached {session.name}:\n{output[-4000:]}"
    result = results[session.name]
    script = Path(scripts[session.name])
    assert not result["error"], f"{session.name}:\n{script.read_text()}\n{result['error']}"
    check_printed(session, result["printed"])


def test_doc_blocks_are_found_and_skips_say_why():
    """Catches the block parser silently finding nothing (then no block would be tested) and a
    block skipped without the reason it cannot run."""
    assert len(SESSIONS) >= 25
    assert all(len(block.skip) > 10 for block in doc_blocks.skipped())
    assert all(len(session.slow) > 10 for session in SESSIONS if session.slow)


def test_output_comparison_is_strict_where_it_matters():
    """Catches the comparison accepting a loss off by a factor (the bug it exists for) or
    rejecting the last-digit differences between CPUs it must allow."""
    shown = "step 0 loss 5.571\n...\nstep 19 loss 2.912"
    assert doc_blocks.output_matches(shown, "step 0 loss 5.572\nstep 1 loss 4.1\nstep 19 loss 2.911")
    assert not doc_blocks.output_matches(shown, "step 0 loss 2.786\nstep 19 loss 1.456")
    assert not doc_blocks.output_matches("loaded 48 tensors", "loaded 47 tensors from x")
    assert doc_blocks.output_matches("loaded 48 tensors from ...", "loaded 48 tensors from ckpt/a")


@pytest.mark.parametrize("session", SESSION_PARAMS)
def test_doc_block_prints_no_third_party_line(session, launches):
    """Catches a block that, run as its page says, shows the reader a library's warning, notice or
    banner (DeepSpeed's accelerator line under the Trainer, Accelerate's "Removed shared tensor" on
    a tied model, Lightning's GPU/TPU lines and tips): the page's code must quiet it, as the
    examples do (tests/test_examples.py holds them to the same rule)."""
    results, output, _ = launches(session.launch)
    assert session.name in results, f"the launch never reached {session.name}:\n{output[-4000:]}"
    printed = "".join(results[session.name]["printed"])
    assert_no_warning(session_output(output, session.name) + printed, f"{session.name}'s output")


# Third-party warnings a page's own code can avoid, by a line each output must not hold.
AVOIDABLE = {
    "50256": "a GPT-2 config over a small vocabulary keeping GPT-2's token ids (bos/eos 50256): "
             "from_pretrained warns that they are outside the vocabulary",
    "loss_type=None": "a GPT-2 model without model.loss_type = \"ForCausalLM\": transformers warns once per rank "
                      "that the class GPT2LMHeadModel names no loss",
}


@pytest.mark.parametrize("key", LAUNCH_PARAMS)
def test_doc_blocks_print_no_avoidable_warning(launches, key):
    """Catches a page whose code makes a library warn where a line of it would not: a GPT-2 config
    over a small vocabulary that keeps GPT-2's token ids, a GPT-2 model whose loss type is unset."""
    _, output, _ = launches(key)
    warned = [line for line in output.splitlines() if any(text in line for text in AVOIDABLE)]
    assert warned == [], f"launch {key}:\n" + "\n".join(warned) + "\n" + "\n".join(
        why for text, why in AVOIDABLE.items() if any(text in line for line in warned))


def test_the_snippets_issue_44_found_broken_run_as_their_pages_say():
    """Catches a snippet tested another way than its page says to run it: docs/your-own-model.md's
    Accelerate loop passed as one process while it failed under torchrun on CPU (no `cpu=True`), and
    docs/several-machines.md's mesh read os.environ["WORLD_SIZE"], which `python train.py` has not."""
    accelerate = [s for s in SESSIONS if s.name.startswith("docs/your-own-model.md")
                  and "ShardwiseAccelerator(" in s.blocks[0].code]
    assert accelerate and all(s.torchrun >= 2 for s in accelerate), [s.name for s in accelerate]
    mesh = [s for s in SESSIONS if s.name.startswith("docs/several-machines.md")
            and "init_device_mesh(" in s.blocks[0].code]
    assert sorted(s.torchrun for s in mesh) == [0, 4], [s.name for s in mesh]
    assert 'os.environ["WORLD_SIZE"]' not in mesh[0].blocks[0].code
