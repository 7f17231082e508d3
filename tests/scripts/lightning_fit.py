"""Run under torchrun by tests/test_lightning.py: a LightningModule holding GPT-2 (from a config)
trained a few steps with clipping and accumulation, plain Lightning or ShardwiseStrategy."""

import argparse
import json
import os
import warnings

import lightning as L
import torch
import transformers

import shardwise as sw
from shardwise.integrations.lightning import ShardwiseStrategy

warnings.filterwarnings("ignore")
parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="none")
parser.add_argument("--max-steps", type=int, default=3)
parser.add_argument("--save", default=None)
parser.add_argument("--resume", default=None)
parser.add_argument("--out", required=True)
parser.add_argument("--resume-to", type=int, default=None,
                    help="then a fresh trainer in this process resumes --save's checkpoint to this step")
parser.add_argument("--resumed-out", default=None)
parser.add_argument("--muon", action="store_true", help="manual optimization: Muon on matrices, AdamW on the rest")
args = parser.parse_args()
torch.set_num_threads(1)
world = int(os.environ.get("WORLD_SIZE", "1"))
GLOBAL_BATCH, ACCUMULATE = 8, 1 if args.muon else 2


class LitGPT(L.LightningModule):
    def __init__(self):
        super().__init__()
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=16,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.model = transformers.GPT2LMHeadModel(config)
        self.losses = []
        self.automatic_optimization = not args.muon  # two optimizers: Lightning steps them by hand only

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.detach())
        if args.muon:
            self.manual_backward(loss)
            for optimizer in self.optimizers():
                optimizer.step()
                optimizer.zero_grad()
        return loss

    def configure_optimizers(self):
        if args.muon:
            return [torch.optim.Muon([p for p in self.parameters() if p.dim() == 2], lr=0.02),
                    torch.optim.AdamW([p for p in self.parameters() if p.dim() != 2], lr=1e-2, eps=1e-3)]
        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-3)




def fit(max_steps: int, resume: str | None, save: str | None, out: str) -> None:
    torch.manual_seed(0)
    module = LitGPT()
    data = torch.randint(0, 128, (GLOBAL_BATCH * ACCUMULATE * 3, 8), generator=torch.Generator().manual_seed(1))
    # One epoch is 3 steps, so a checkpoint at step 3 resumes at an epoch start.
    # Micro-batch k of the global batch is the reference's micro-batch k, split between the ranks.
    micro, rank = GLOBAL_BATCH // ACCUMULATE, int(os.environ.get("RANK", "0"))
    per_rank = micro // world
    order = [k * micro + rank * per_rank + i for k in range(len(data) // micro) for i in range(per_rank)]
    loader = torch.utils.data.DataLoader(data, batch_size=per_rank, sampler=order)
    strategy = "auto" if args.strategy == "none" else ShardwiseStrategy(args.strategy)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=max_steps,
                        gradient_clip_val=None if args.muon else 0.5, accumulate_grad_batches=ACCUMULATE,
                        enable_checkpointing=False,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(module, loader, ckpt_path=resume)
    if save:
        trainer.save_checkpoint(save)
    losses = torch.stack(module.losses) if module.losses else torch.zeros(0)
    if world > 1:
        torch.distributed.all_reduce(losses, op=torch.distributed.ReduceOp.AVG)
    params = sw.full_parameters(module)
    if rank == 0:
        result = {"losses": losses.tolist(), "global_step": trainer.global_step, "epoch": trainer.current_epoch,
                  "params": {k: v.flatten().tolist() for k, v in params.items()}}
        with open(out, "w") as f:
            json.dump(result, f)


fit(args.max_steps, args.resume, args.save, args.out)
if args.resume_to is not None:  # plain Lightning's reference resume, one process fewer (tests/test_lightning.py)
    fit(args.resume_to, args.save, None, args.resumed_out)
