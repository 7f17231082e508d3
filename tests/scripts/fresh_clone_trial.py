"""The first hour as a new user takes it, on a fresh clone: each step timed, its noise listed.

    d=$(mktemp -d) && git clone -q . $d && (cd $d && make setup)
    python3 tests/scripts/fresh_clone_trial.py $d /tmp/trial [docs|examples|cli|all]

Steps, in the order a reader meets them: every Python block of README.md, getting started and
your own model, saved as `train.py` (with the setup its HTML comment gives: the reader's own
objects) and run as the page says (`python train.py`, or `OMP_NUM_THREADS=1 torchrun ...`);
the two launches getting started shows; each command of examples/README.md; each CLI command
the README and docs show, on a checkpoint the first example wrote; `make docs`. A line that
looks like an error, a traceback or a third-party warning is listed under its step; each
step's whole output goes to TRIAL/logs, and every result to TRIAL/results_PART.json. Wall
times depend on what else runs on the machine: record `uptime` beside them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

NOISE = re.compile(r"traceback|error|warn|deprecat|tip:|^\[rank\d*\]|site-packages|omp_num_threads|gpu available|"
                   r"^\[transformers\]|initializing distributed|distributed_backend|removed shared", re.I)
# Not the project's: this machine's pip configuration, and the variable name in `make docs`' echoed command.
NOT_NOISE = ("WARNING: Location 'file:///", "NO_MKDOCS_2_WARNING")
EXAMPLES = ["examples/hf_causal_lm.py --max-steps 200 --out out/run1",
            "examples/hf_causal_lm.py --max-steps 200 --out out/run1",  # started again: resumes, then ends
            "examples/hf_trainer.py --max-steps 100",
            "examples/accelerate_lm.py --max-steps 100",
            "examples/lightning_lm.py --max-steps 100",
            # issue 36/33: the Trainer's bf16 and a factored optimizer, saved at 3, resumed to 6
            "examples/hf_trainer.py --max-steps 3 --save-every 3 --optim adafactor --bf16 --out out/trainer_adafactor",
            "examples/hf_trainer.py --max-steps 6 --save-every 3 --optim adafactor --bf16 --out out/trainer_adafactor"]
QWEN2 = ("shardwise plan qwen2 hidden_size=896 num_hidden_layers=24 intermediate_size=4864 num_attention_heads=14 "
         "num_key_value_heads=2 vocab_size=151936 tie_word_embeddings=true --memory 8GiB --world-size 4 --batch 4 "
         "--seq 1024")
MY_MODEL = '''import transformers
def build():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, num_hidden_layers=22, num_attention_heads=16,
        num_key_value_heads=16, intermediate_size=5632, max_position_embeddings=2048))
'''
MYMODEL = '''from transformers import AutoConfig, AutoModelForCausalLM


def gpt2_small():
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2"))   # 124M parameters
'''
CLI = ["shardwise --help",
       "shardwise plan my_model:build --memory 12GiB --world-size 8 --batch 2 --seq 1024",
       "shardwise units my_model:build --world-size 8",
       "shardwise estimate my_model:build --strategy zero3 --world-size 8 --batch 2 --seq 1024",
       "shardwise estimate gpt d_model=512 n_layers=8 vocab_size=8192 seq_len=128 --strategy zero3 --world-size 4 "
       "--precision bf16 --batch 4 --seq 128",
       "shardwise units llama hidden_size=512 num_hidden_layers=4",
       "shardwise plan mymodel:gpt2_small --memory 1GiB --world-size 8",
       "shardwise plan gpt2 --memory 1GiB --world-size 8",
       "shardwise units gpt2",
       QWEN2,  # issue 36 point 5: the rows change with --checkpoint-activations
       QWEN2 + " --checkpoint-activations"]


class Trial:
    """Runs steps in the clone's environment and keeps what each did."""

    def __init__(self, clone: Path, work: Path):
        self.clone, self.work, self.results = clone, work, []
        (work / "logs").mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PATH": f"{clone}/.venv/bin:{os.environ['PATH']}", "VIRTUAL_ENV": f"{clone}/.venv"}
        for name in ("PYTHONPATH", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                     "OMP_NUM_THREADS"):
            self.env.pop(name, None)  # a reader's shell has none of these

    def step(self, name: str, command: str, cwd: Path) -> None:
        start = time.time()
        done = subprocess.run(command, shell=True, cwd=cwd, env=self.env, capture_output=True, text=True)
        wall, output = time.time() - start, done.stdout + done.stderr
        noisy = [line for line in output.splitlines()
                 if NOISE.search(line) and not any(text in line for text in NOT_NOISE)]
        self.results.append({"step": name, "command": command, "rc": done.returncode, "wall_s": round(wall, 1),
                             "noise": noisy})
        print(f"{name:60s} rc={done.returncode} {wall:6.1f} s  noise lines: {len(noisy)}", flush=True)
        for line in noisy[:5]:
            print(f"    ! {line[:200]}", flush=True)
        (self.work / "logs" / (re.sub(r"\W+", "_", name)[:80] + ".log")).write_text(f"{command}\n{output}")


def doc_steps(trial: Trial) -> None:
    """Each page's sessions as files a reader would save, run as the page says."""
    sys.path.insert(0, str(trial.clone / "tests"))
    from helpers import doc_blocks  # the clone's own parser: the same sessions make test runs

    for page in ("README.md", "docs/getting-started.md", "docs/your-own-model.md"):
        sessions: list[list] = []
        for block in doc_blocks.parse(trial.clone / page):
            if block.skip:
                print(f"{block.name} not run: {block.skip}")
            elif block.continues and sessions:
                sessions[-1].append(block)
            else:
                sessions.append([block])
        for blocks in sessions:
            folder = trial.work / re.sub(r"\W+", "_", blocks[0].name)
            folder.mkdir(exist_ok=True)
            (folder / "train.py").write_text("".join(b.setup + "\n" + b.code for b in blocks))
            lines, ranks = "+".join(str(b.line) for b in blocks), blocks[0].torchrun
            command = (f"OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node {ranks} train.py" if ranks
                       else "python train.py")
            trial.step(f"{page}:{lines} {command.split(' train')[0]}", command, folder)
            if page == "docs/getting-started.md" and blocks[0].line == 28:
                trial.step("getting started: python train.py (one process)", "python train.py", folder)


def main() -> None:
    clone, work = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    part = sys.argv[3] if len(sys.argv) > 3 else "all"
    trial = Trial(clone, work)
    if part in ("docs", "all"):
        doc_steps(trial)
    if part in ("examples", "all"):
        for command in EXAMPLES:
            trial.step(command.split(" ")[0], f"OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 {command}",
                       clone)
    if part in ("cli", "all"):
        folder = work / "cli"
        folder.mkdir(exist_ok=True)
        (folder / "my_model.py").write_text(MY_MODEL)  # README's `cat my_model.py`
        (folder / "mymodel.py").write_text(MYMODEL)    # estimator.md's mymodel.py
        for command in CLI:
            trial.step(command, command, folder)
        saved = sorted((clone / "out" / "run1").glob("step-*"))  # the first example's checkpoints
        if len(saved) >= 2:
            for command in (f"shardwise ckpt inspect {saved[-1]}",
                            f"shardwise ckpt export {saved[-1]} exported/model.safetensors --mkdir",
                            f"shardwise ckpt diff {saved[-2]} {saved[-1]}",
                            f"shardwise ckpt diff {saved[-2]} {saved[-1]} --values",
                            # issue 36 point 4: the export beside its config.json loads as the model
                            "python -c \"from transformers import AutoModelForCausalLM as A; "
                            "print(type(A.from_pretrained('exported')).__name__)\""):
                trial.step(command.replace(str(clone) + "/", ""), command, folder)
        trial.step("make docs", "make docs", clone)
    (work / f"results_{part}.json").write_text(json.dumps(trial.results, indent=1))


if __name__ == "__main__":
    main()
