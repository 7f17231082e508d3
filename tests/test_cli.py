"""The `shardwise` command and the demo's argument handling (no training here)."""

import json
import subprocess
import sys

import pytest

from shardwise import cli, demo


def test_help_lists_the_commands(capsys):
    """Catches a broken console entry point or a subcommand missing from --help."""
    assert cli.main([]) == 0
    assert "demo" in capsys.readouterr().out


def test_console_script_runs():
    """Catches pyproject's `shardwise` script pointing at a function that does not exist."""
    done = subprocess.run([sys.executable, "-m", "shardwise.cli", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and "shardwise" in done.stdout


def test_demo_rejects_an_unknown_strategy(capsys):
    """Catches a typo in --strategy launching ranks that then fail deep inside shard()."""
    assert demo.main(["--strategy", "zero9"]) == 2
    assert "zero9" in capsys.readouterr().err


@pytest.mark.parametrize("given", [["--strategy", "zero3"], ["--strategy=zero3"], ["--strat", "zero3"]])
def test_demo_starts_ranks_with_options_they_parse(monkeypatch, tmp_path, capsys, given):
    """Catches `python -m shardwise.demo --strategy zero3` (what `make demo STRATEGY=zero3` runs)
    starting ranks with a stray `zero3` they refuse (torchrun then prints their tracebacks), and
    `--nproc` handed on where torchrun takes it for an abbreviation of its --nproc-per-node: torchrun
    and every rank must parse what they are handed, each run its strategy, the other options kept."""
    import torch.distributed.run

    started = []

    def fake_torchrun(argv):  # a rank's parse, then the result file a run leaves
        torchrun_parser = torch.distributed.run.get_args_parser()
        torchrun_parser.parse_args(argv)  # SystemExit(2) if torchrun takes a rank's option for its own
        rank = demo.parse_args(argv[argv.index("shardwise.demo") + 1:])  # SystemExit(2) on a stray argument
        started.append((rank.strategy, rank.nproc, rank.steps, rank.out))
        result = {"strategy": rank.strategy, "params": 10, "losses": [2.0, 1.0], "median_step_s": 0.1,
                  "model_state_mib": [1.0], "peak_rss_mib": [2.0]}
        (tmp_path / f"{rank.strategy.replace(' ', '_')}.json").write_text(json.dumps(result))

    monkeypatch.setattr(torch.distributed.run, "main", fake_torchrun)
    monkeypatch.setattr(demo, "plot_losses", lambda results, path: None)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # launch() sets both when unset: keep them out of later tests
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert demo.main([*given, "--nproc", "3", "--steps", "4", "--out", str(tmp_path)]) == 0
    assert started == [("zero3", 3, 4, str(tmp_path)), (demo.REFERENCE, 3, 4, str(tmp_path))]
    assert "zero3" in capsys.readouterr().out


def test_demo_text_is_the_same_everywhere():
    """Catches the demo's data depending on something other than the stdlib's own files."""
    text = demo.load_text(max_bytes=10_000)
    assert text.shape == (10_000,) and int(text.max()) < demo.BYTE_VOCAB
    x, y = demo.global_batch(text, step=3, size=4, seq=16)
    assert torch_equal(x[:, 1:], y[:, :-1])


def torch_equal(a, b):
    return bool((a == b).all())


def test_ckpt_commands(tmp_path, capsys):
    """Catches `shardwise ckpt` inspect/export/diff breaking: inspect must verify checksums
    and fail on a corrupt file, export must write a file plain torch loads, diff must name
    the keys and shapes that differ."""
    import safetensors.torch
    import torch

    import shardwise as sw
    from shardwise.models.zoo import build

    model = build("gpt")
    sw.save(tmp_path / "a", model, torch.optim.AdamW(model.parameters()), step=7)
    assert cli.main(["ckpt", "inspect", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "tok_emb.weight" in out and "tied: head.weight" in out and "every file is intact" in out
    assert "'step': 7" in out and "world size 1" in out

    assert cli.main(["ckpt", "export", str(tmp_path / "a"), str(tmp_path / "m.safetensors")]) == 0
    plain = build("gpt", seed=3)
    safetensors.torch.load_model(plain, tmp_path / "m.safetensors")
    assert torch.equal(plain.tok_emb.weight, model.tok_emb.weight)

    assert cli.main(["ckpt", "diff", str(tmp_path / "a"), str(tmp_path / "m.safetensors"), "--values"]) == 0
    sw.save(tmp_path / "b", build("odd_shapes"))
    assert cli.main(["ckpt", "diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert "- tok_emb.weight [64, 32]" in out and "+ scale []" in out

    file = tmp_path / "a" / "rank-00000-of-00001.safetensors"
    data = bytearray(file.read_bytes())
    data[-100] ^= 0xFF
    file.write_bytes(bytes(data))
    assert cli.main(["ckpt", "inspect", str(tmp_path / "a")]) == 1
    assert "CORRUPT" in capsys.readouterr().out
    assert cli.main(["ckpt", "inspect", str(tmp_path)]) == 2
    assert "not a shardwise checkpoint" in capsys.readouterr().err
    assert cli.main(["ckpt"]) == 0 and "inspect" in capsys.readouterr().out


def test_demo_summary_shows_the_drift_of_ddp_itself_and_the_formula(capsys):
    """Catches the demo printing ddp and zero3 losses that differ with nothing saying torch's DDP
    drifts from one process as much, and model state without the 16/N formula beside it."""
    def run(strategy, losses, state):
        return {"strategy": strategy, "world_size": 2, "params": 1_000_000, "losses": losses,
                "median_step_s": 0.1, "peak_rss_mib": [400.0, 400.0], "model_state_mib": [state, state]}
    demo.print_summary([run("ddp", [5.0, 3.0001], 15.3), run("zero3", [5.0, 2.9998], 7.7),
                        run(demo.REFERENCE, [5.0, 3.0], 15.3)], world_size=2)
    out = capsys.readouterr().out
    assert "max |loss - 1 proc|" in out and "1.0e-04" in out and "2.0e-04" in out, out
    assert "(15.3)" in out and "(7.6)" in out, out  # 16 and 16/2 bytes per parameter
    assert "by as much as torch's DDP does" in out


def test_a_reader_that_stops_reading_ends_the_command_quietly(small):
    """Catches `shardwise ckpt inspect DIR | head` ending in a BrokenPipeError traceback (issue 60 item 13):
    the reader here closes the pipe before the command writes anything, as `head` does after its lines; the
    command ends with a shell's SIGPIPE status and nothing on stderr."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-m", "shardwise.cli", "ckpt", "inspect", str(small)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()  # the reader is gone before the first write
    stderr = child.stderr.read().decode()
    assert child.wait(timeout=120) == 141, stderr
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr
