"""Deliberate mutations of the engine, and the test that must catch each (issue 10's table).

    python bench/mutations.py            # every mutation: copy src/, apply it, run its tests

Each mutation is (name, function, text, replacement, tests to run). The function is named by
its qualified name (`FlatUnit.needs_gather`, `ZeroEngine._make_pre_forward.hook`, `any_rank`)
and found wherever it lives under src/shardwise, and the text must occur exactly once in it: a
refactor that moves code between files keeps every mutation; one that rewrites the marked line
says which mutation and function to update. A mutation no test catches is a missing test.
Writes bench/results/mutations.md.
"""

from __future__ import annotations

import ast
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MUTATIONS = [
    ('skip the stale mark of an optimizer step (fused kernels unseen)',
     'FlatUnit.needs_gather',
     'return self.stale or self._master_stamp() != self.gathered_stamp',
     'return self._master_stamp() != self.gathered_stamp',
     'tests/test_optimizers.py -k fused'),
    ("skip zero3's re-gather of a unit freed since its last use (A, B, A)",
     'GatherScheduler.ensure_gathered',
     'elif not unit.stage.keeps_full_params and unit.needs_gather():',
     'elif False:',
     'tests/test_zero_parity.py -k non_consecutive'),
    ('reduce in the compute dtype, not reduce_dtype',
     'FlatUnit.__init__',
     'self.reduce_dtype = precision.reduce_dtype if',
     'self.reduce_dtype = precision.param_dtype if',
     'tests/test_misuse.py -k reduce_dtype'),
    ('average the gradients twice',
     'UnitGrads.land',
     'rows = reduced[offset : offset + layout.shard_numel].view(layout.shard_shape).to(unit.dtype)',
     'rows = reduced[offset : offset + layout.shard_numel].view(layout.shard_shape).to(unit.dtype) / 2',
     "tests/test_zero_parity.py -k 'gpt and 2'"),
    ('a new window per forward pass (late gradients of a second forward dropped)',
     'ZeroEngine._enter_unit',
     '            if id(unit) not in self.step.fulls:',
     '            if True:',
     'tests/test_zero_parity.py -k two_tower'),
    ("drop the 'used' flags (unused parameters get zero gradients)",
     'UnitGrads.start_reduce',
     'self.used_here = [grads[i] is not None for i in self.indices]',
     'self.used_here = [True for i in self.indices]',
     'tests/test_zero_parity.py -k unused_branch'),
    ('install a tied parameter under its first name only',
     'FlatUnit.install_shards',
     'for module, attribute in layout.owned.holders:\n                module._parameters[attribute] = shard',
     'for module, attribute in layout.owned.holders[:1]:\n                module._parameters[attribute] = shard',
     'tests/test_state_dict.py -k between_steps'),
    ('requires_grad left out of the cross-rank check',
     'check_same_model_on_every_rank',
     'str(p.dtype), p.requires_grad)',
     'str(p.dtype), True)',
     'tests/test_misuse.py -k freeze_different'),
    ('each rank re-gathers on its own verdict (no agreement)',
     'agree_before_forward',
     'return [unit for unit, flag in zip(units, rows[:, len(header):].amax(0).tolist()) if flag], same_order',
     'return [unit for unit in units if unit.needs_gather()], same_order',
     'tests/test_optimizers.py -k one_rank'),
    ('p.data with its own version counter',
     'ShardParameter.data',
     '        return self.detach()  # shares the version counter',
     '        return super().data  # own counter',
     "tests/test_optimizers.py -k 'writes and data'"),
    ('a new Parameter object per shard (an optimizer built first steps nothing)',
     'make_shard',
     '    if isinstance(original, nn.Parameter) and original.device.type != "meta"',
     '    if False and isinstance(original, nn.Parameter) and original.device.type != "meta"',
     'tests/test_optimizers.py -k before'),
    ('no state_dict hooks (shards that look whole)',
     'ZeroEngine.__init__',
     '        install_state_dict_hooks(model, self)  # Note [state dict]',
     '',
     'tests/test_state_dict.py'),
    ('no guard against a second DDP wrapper',
     'shard',
     '    setattr(model, DDP_IGNORE_ATTRIBUTE, RefuseDataParallel(config.strategy))',
     '',
     'tests/test_misuse.py -k ddp'),
    ("free nothing after a frozen unit's backward (zero3)",
     'ZeroEngine._frozen_backward_done',
     '        if not any(unit is u for u in self.step.open_units):\n            unit.free()',
     '        pass',
     'tests/test_engine_patterns.py -k frozen'),
    ('restore no gradient carried over from an earlier backward (zero1)',
     'UnitGrads.settle',
     '            if carried is not None:\n                self.unit.shard_params[i].grad = carried',
     '            pass',
     "tests/test_engine_patterns.py -k 'branches and zero1'"),
    ('free idle units during a recompute (zero3)',
     'ZeroEngine._make_pre_forward.hook',
     'if in_backward():  # Note [recompute] (recompute.py)\n                self._prepare_recompute(unit)\n',
     'if in_backward():\n                self._open_unit(unit)\n',
     "tests/test_engine_patterns.py -k 'checkpoint_around and zero3'"),
    ("keep a zero3 unit's full values after its backward",
     'ZeroEngine.post_backward',
     '            # worth less at the backward peak; bench/max_model.py).\n            unit.free()',
     '            # worth less at the backward peak; bench/max_model.py).\n            pass',
     'tests/test_zero_engine.py'),
    ("no hooks on the root unit's modules (an embedding called alone reads this rank's rows)",
     'ZeroEngine.__init__',
     'for module in root_scope_modules(model, [unit.module for unit in self.units[1:]]):',
     'for module in []:',
     'tests/test_engine_patterns.py -k outside_the_forward_see'),
    ('a unit called alone opens no pass (zero3: left gathered after it returns)',
     'ZeroEngine._make_pre_forward.hook',
     '                if unit is not self.root:\n                    self._open_outer_call(module)',
     '                if False:\n                    pass',
     'tests/test_engine_patterns.py -k outside_the_forward_see'),
    ("no check for a backward nested in the window's (reentrant checkpoint)",
     'refuse_nested_backward',
     '    if nested or step.callback_queued and',
     '    if False and',
     'tests/test_engine_patterns.py -k reentrant'),
    ('free() leaves the freed full views registered (zero3)',
     'FlatUnit.free',
     '            self._move(Residency.SHARDED)\n            self.install_shards()',
     '            self._move(Residency.SHARDED)',
     "tests/test_engine_patterns.py -k 'penalty_over_the_parameters_after and zero3'"),
    ("torch's clip_grads_with_norm_ not refused on shards",
     'RowsGrad.__torch_function__',
     '        if func in _ROW_NORMS:',
     '        if False:',
     'tests/test_misuse.py -k clip'),
    ("gloo all-to-all form adds this rank's own copy twice, not every rank's",
     '_average_copies',
     'mean = torch.add(by_rank[0], by_rank[1], out=out)',
     'mean = torch.add(by_rank[0], by_rank[0], out=out)',
     "tests/test_zero_parity.py -k 'single_process and gpt and zero2 and 2'"),
    ("issue 21: sharded parameters step in torch's per-tensor loop, not its foreach kernels",
     'allow_foreach',
     'supported.append(tensor_type)',
     'pass',
     'tests/test_compat.py -k foreach'),
    ("issue 22: rank 0 creates a missing rank's count-in key and says go without it",
     '_host_join',
     'if r not in missing and int(store.get(f"shardwise/{token}/joined/{r}")) > 1]',
     'if store.add(f"shardwise/{token}/joined/{r}", 0) > 1]',
     'tests/test_dist.py -k never_taken'),
    ('gloo gather broadcasts every row from rank 0',
     'all_gather',
     'works = [dist.broadcast(rows, src=dist.get_global_rank(group, rank), group=group, async_op=True)',
     'works = [dist.broadcast(rows, src=dist.get_global_rank(group, 0), group=group, async_op=True)',
     "tests/test_zero_parity.py -k 'single_process and gpt and zero3 and 2'"),
    ("optimizer in backward keeps each gradient after its unit's step",
     'UnitStepper.after_reduce',
     '            shard.grad = None  # the point',
     '            pass  # the point',
     "tests/test_optimizer_in_backward.py -k 'zero2 and gpt'"),
    ('optimizer in backward lets a second synced backward step again',
     'UnitStepper.after_reduce',
     '            if self.awaiting_step:',
     '            if False:',
     "tests/test_optimizer_in_backward.py -k 'refused and backwards'"),
    ('issue 20: every optimizer steps rows (Muon, Adafactor, LAMB on slices)',
     'step_shape',
     '    if kind in _ELEMENTWISE:\n        return StepShape.ROWS',
     '    if True:\n        return StepShape.ROWS',
     "tests/test_whole_tensor_optim.py -k 'zero2 and muon'"),
    ("issue 20: the owner's whole update never written back to the rows",
     'WholeStep.end',
     '                param.view(-1)[: own.numel()].copy_(own)',
     '                pass',
     "tests/test_whole_tensor_optim.py -k 'zero1 and adafactor'"),
    ('issue 20: owners chosen per rank, not the same on every rank',
     '_owners',
     'owner = min(range(world_size), key=lambda r: (load[r], r))',
     'owner = min(range(world_size), key=lambda r: (load[r], r)) if dist.get_rank() else world_size - 1',
     'tests/test_whole_tensor_optim.py -k four_ranks'),
    ('issue 20: LBFGS not refused',
     '_begin_whole_step',
     '    if shape is StepShape.REFUSE:\n        refuse_coupled(optimizer)',
     '    if False:\n        pass',
     'tests/test_whole_tensor_optim.py -k lbfgs'),
    ('issue 20: parameter hooks never run',
     'GatherUnit.backward',
     'grads = [grad if grad is None else run_grad_hooks(shard, grad)',
     'grads = [grad if True else run_grad_hooks(shard, grad)',
     'tests/test_habits.py -k hook'),
    ('issue 20: a shard meeting a full-shape tensor goes unchecked (silent EMA broadcast)',
     'ShardParameter.__torch_function__',
     '                _refuse_rows_with_whole(func, args, kwargs)',
     '                pass',
     'tests/test_habits.py -k broadcast'),
    ('issue 20: autograd.grad over shards not refused',
     'GatherUnit.backward',
     'if ctx.num_shards and reach(ctx.next_functions[0][0]) is Reach.CAPTURES:',
     'if False:',
     "tests/test_habits.py -k 'whole_tensor_habits and zero2'"),
    ('issue 20: an optimizer of another model steps nothing, silently',
     '_refuse_optimizer_of_nothing',
     '    if params and not any(',
     '    if False and not any(',
     "tests/test_habits.py -k 'whole_tensor_habits and zero1'"),
    ('issue 20: sw.EMA moves by decay, not 1 - decay',
     'EMA.update',
     'self.average[name].lerp_(param.detach(), 1.0 - self.decay)',
     'self.average[name].lerp_(param.detach(), self.decay)',
     'tests/test_habits.py -k ema'),
    ('issue 20: sparse embeddings reach the flat reduce',
     '_refuse_sparse_gradients',
     'and module.sparse:',
     'and module.sparse and False:',
     'tests/test_habits.py -k sparse'),
    ("issue 20: a gradient penalty's autograd.grad opens the step's reduce",
     'ZeroEngine._pre_backward',
     '        if in_grad_call(unit):',
     '        if False:',
     'tests/test_double_backward.py -k zero2'),
    ("issue 20: zero3 frees what a gradient penalty's graph reads",
     'ZeroEngine._pre_backward',
     '            unit.pin()',
     '            pass',
     "tests/test_double_backward.py -k 'zero3 and True'"),
    ("issue 20: clipping's norm without torch's per-tensor arithmetic",
     '_clip_sharded',
     '        total = torch.nn.utils.get_total_norm(grads, norm_type)',
     '        total = sum(g.double().pow(2).sum() for g in grads).sqrt().float()',
     'tests/test_clip.py'),
    ('issue 21: the used flags are not agreed across ranks (each rank keeps its own)',
     'any_rank',
     '        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=host_group)',
     '        pass',
     'tests/test_zero_engine.py -k divergent'),
    ('issue 21: the gather scheduler frees a unit whose forward is running (zero3)',
     'GatherScheduler.free_idle',
     'busy = keep | {id(u) for u in running} | set(self.prefetching)',
     'busy = keep | set(self.prefetching)',
     "tests/test_zero_parity.py -k 'single_process and gpt and zero3 and 2'"),
    ("issue 21: zero1's first backward of a window adds to the last window's kept gradients",
     'UnitGrads._begin_accumulation',
     'self._pack(grads, self._every_index(), out=self.full)',
     'self.full.add_(self._pack(grads, self._every_index()))',
     "tests/test_zero_parity.py -k 'gpt and zero1 and 2'"),
    ("issue 21: zero1's averaged rows not copied into its kept gradients (torch's reduce-scatter form)",
     'UnitGrads._give',
     '            if own.data_ptr() != rows.data_ptr():\n                own.copy_(rows)',
     '            pass',
     "tests/test_zero_parity.py -k 'gpt and zero1 and 2'"),
    ("issue 21: zero1's kept gradients count every parameter as used (unused ones get zero gradients)",
     'UnitGrads.start_reduce',
     'self.used_here = [i in self.used for i in self.indices]',
     'self.used_here = [True for i in self.indices]',
     "tests/test_zero_parity.py -k 'unused_branch and zero1'"),
    ("issue 21: zero2/zero3 average into their no_sync buffer, which then outlives the step",
     'UnitGrads.start_reduce',
     '                if unit.stage.keeps_full_grads:  # zero1',
     '                if True:  # zero1',
     'tests/test_zero_engine.py -k no_sync_full'),
    ('issue 21: an aborted backward keeps its partial gradients',
     'UnitGrads.drop',
     '            shard.grad = None',
     '            pass',
     'tests/test_engine_patterns.py -k midway'),
    ("issue 21: a gather leaves a low-precision zero1/zero2 unit's own rows of its compute copy stale",
     'FlatUnit.start_gather',
     'own_in_place=self.aliased)',
     'own_in_place=True)',
     "tests/test_precision.py -k 'bf16 and zero2'"),
    ("issue 21: the gather skips another rank's rows, not this rank's own",
     'gather_into.finish',
     'skip_rank=rank if own_in_place else None',
     'skip_rank=(rank + 1) % world_size if own_in_place else None',
     "tests/test_zero_parity.py -k 'gpt and zero2 and 2'"),
    ("issue 21: a parameter gathered in place misses this rank's own rows (zero3's shards live apart)",
     'gather_into',
     '                by_rank[rank].copy_(part)',
     '                pass',
     "tests/test_zero_parity.py -k 'in_place and zero3'"),
    ("issue 21: a parameter gathered in place takes every rank's rows into this rank's place",
     'gather_into',
     'target = part if src == rank else by_rank[src]',
     'target = part if src == rank else by_rank[rank]',
     "tests/test_zero_parity.py -k 'in_place and zero2'"),
    ("issue 21: the packed small parameters' sizes read in another order than they were sent",
     'gather_into.finish',
     'sizes = [rows[i].numel() for i in packed]',
     'sizes = [rows[i].numel() for i in reversed(packed)]',
     "tests/test_zero_parity.py -k 'in_place and zero1'"),
    ("issue 21: the sliced inf-norm is this rank's alone",
     'clip_sliced_grad_norm_',
     '        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)',
     '        pass',
     'tests/test_slicing.py -k clip'),
    ("issue 21: a two-argument op of rows and a whole tensor skips the check (ShardParameter's fast path)",
     'ShardParameter.__torch_function__',
     'if (len(args) > 1 or kwargs) and func not in _REBINDS:',
     'if (len(args) > 2 or kwargs) and func not in _REBINDS:',
     'tests/test_habits.py -k whole_tensor_habits'),
    ("issue 21: a zero3 unit's free is not counted (the peak of units held at once only grows)",
     'FlatUnit._move',
     'self.residents.add((to is Residency.GATHERED) - (self.residency is Residency.GATHERED))',
     'self.residents.add(max(0, (to is Residency.GATHERED) - (self.residency is Residency.GATHERED)))',
     "tests/test_zero_engine.py -k 'memory_at_the_zero_bound and zero3'"),
    ("let dynamo trace the engine's unit hooks (torch.compile's RecursionError)",
     'ZeroEngine.__init__',
     'unit.module.register_forward_pre_hook(outside_graph(self._make_pre_forward(unit)))',
     'unit.module.register_forward_pre_hook(self._make_pre_forward(unit))',
     "tests/test_compile.py -k 'gpt and zero3 and whole'"),
    ('run the eager recompute hook inside a compiled checkpoint (the unit silently falls back to eager)',
     'checkpoint_forward.recompute_or_run',
     'if not torch.compiler.is_compiling() and graph_task_id() != -1:',
     'if graph_task_id() != -1:',
     'tests/test_compile.py -k checkpointed'),
    ('issue 36: ShardwiseTrainer ignores bf16=True (no autocast around the forward)',
     'ShardwiseTrainer.__init__',
     '        if self.accelerator.native_amp:',
     '        if False:',
     'tests/test_trainer_args.py -k bf16'),
    ('issue 36: resume_from_checkpoint=True takes the newest checkpoint, whole or not',
     'last_whole',
     '        if reason is None:',
     '        if True:',
     'tests/test_trainer_checkpoints.py -k skips'),
    ('issue 36: a failed Trainer save leaves its half checkpoint behind',
     'abandon',
     '    if _rank(group) == 0:',
     '    if False:',
     'tests/test_trainer_checkpoints.py -k failed_save'),
    ('issue 36: no rank checks that it sees the directory rank 0 made (node-local disks)',
     '_check_shared',
     '    if seen != job.checkpoint_id:',
     '    if False:',
     'tests/test_export_config.py -k node_local'),
    ('issue 36: the probe ignores checkpoint_activations (no recompute)',
     '_measure',
     '            modules[path].forward = _checkpointed(originals[path])',
     '            pass',
     'tests/test_estimate_probe.py -k recompute'),
    ('issue 36: a Hugging Face config is not recorded at save',
     'model_config',
     '        return json.loads(config.to_json_string(use_diff=False))',
     '        return None',
     'tests/test_export_config.py -k config'),
]


def locate(package: Path, function: str, old: str) -> tuple[Path, int, int] | str:
    """(file, start, end) of the one place `old` occurs in `function` (a qualified name; property
    getter and setter count as one), or why it cannot be mutated."""
    places = []
    for path, start, end in _function_spans(package).get(function, []):
        text = path.read_text()
        found = text.find(old, start, end)
        while found != -1:
            places.append((path, found, found + len(old)))
            found = text.find(old, found + 1, end)
    if len(places) != 1:
        return f"text found {len(places)} times in {function}"
    return places[0]


@functools.cache
def _function_spans(package: Path) -> dict[str, list[tuple[Path, int, int]]]:
    """Every function under `package` by qualified name: (file, start offset, end offset)."""
    spans: dict[str, list[tuple[Path, int, int]]] = {}
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        offsets = [0]
        for line in text.splitlines(keepends=True):
            offsets.append(offsets[-1] + len(line))
        for qualname, node in _functions(ast.parse(text)):
            spans.setdefault(qualname, []).append((path, offsets[node.lineno - 1], offsets[node.end_lineno]))
    return spans


def _functions(tree: ast.AST, prefix: str = ""):
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            qualname = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                yield qualname, child
            yield from _functions(child, qualname + ".")


def run(mutation) -> tuple[str, str, float]:
    name, function, old, new, tests = mutation
    with tempfile.TemporaryDirectory() as scratch:
        src = Path(scratch) / "src"
        shutil.copytree(ROOT / "src", src)
        place = locate(src / "shardwise", function, old)
        if isinstance(place, str):
            return name, place, 0.0
        path, start, end = place
        text = path.read_text()
        path.write_text(text[:start] + new + text[end:])
        env = dict(os.environ, PYTHONPATH=str(src))
        started = time.time()
        done = subprocess.run(f"{sys.executable} -m pytest -q -x -p no:cacheprovider {tests}", shell=True,
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        verdict = "caught" if done.returncode != 0 else "NOT CAUGHT"
        return name, verdict, time.time() - started


def main() -> None:
    wanted = sys.argv[1:]  # optional: substrings of the mutations to run
    rows = []
    for mutation in MUTATIONS:
        if wanted and not any(w in mutation[0] for w in wanted):
            continue
        name, verdict, seconds = run(mutation)
        rows.append(f"| {name} | `{mutation[1]}` | `{mutation[4]}` | {verdict} ({seconds:.0f} s) |")
        print(rows[-1], flush=True)
    if not wanted:  # the whole table only
        table = "| mutation | function | tests run | result |\n|---|---|---|---|\n" + "\n".join(rows) + "\n"
        (ROOT / "bench" / "results" / "mutations.md").write_text(table)


if __name__ == "__main__":
    main()
