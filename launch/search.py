"""`python -m launch.plan --search`: the actor layouts a run supports, ranked by roofline tokens/s per GPU.

    python -m launch.plan --config-file launch/configs/dapo_seed_mi308x.yaml --target mi308x --search
    python -m launch.plan --config-file launch/configs/dapo_seed_mi308x.yaml --target mi355x --nodes 4 \
        --mesh actor:fsdp=2,expert=8/rollout:data=2,expert=8 --search --search-compile 2

Enumerates every actor mesh of the run's actor devices (`--nodes` x `--gpus-per-node` less the rollout's; the
rollout part of the run's mesh is kept) over the six axes (stage, data, fsdp, context, expert, tensor), with
`--learner.pipeline_stages` = the stage axis. A layout the model or the learner cannot take (an axis that does not
divide a model dim, stages that do not divide the pipelined group's repetitions) is dropped with its reason
counted; one the plan arithmetic (parallel/plan.py, GPipe's M micro-batches of saved stage inputs included) says
does not fit is printed as such but never compiled. Every other row gets an arithmetic estimate of its
step (`estimate`), and the `--search-compile` N best that fit are compiled deviceless by XLA:GPU for `--target`
(`launch.aot.compile_actor`, the same child process as `--compile`) and ranked again by their HLO roofline
(launch/roofline.py). Each row prints the flags that run it (`--mesh ... --learner.pipeline_stages P`).

The arithmetic estimate (per device, one step of M micro-batches of T tokens per device of the batch axes;
M = `--pipeline-micro-batches`, default 4 P, for pipelined rows, 1 otherwise; an estimate for ranking, the compiled
roofline is the figure):
  layer-tokens  W = T (M L_o / P + (M + P - 1) L_p / P): the L_o layers outside the pipeline split the batch's rows
                over the stages (`parallel.pipeline.run_split_over_stages`); the L_p pipelined ones run on 1 of P
                stages for M + P - 1 iterations (the GPipe bubble)
  compute       W / L x `parallel.flops.train_flops_per_token` / tensor x REMAT_RATIO / peak flop/s
  HBM           compute's dot flops x HBM_BYTES_PER_FLOP / HBM bytes/s (the compiled seed step's ratio: the same
                kernels on other shards move bytes in proportion to their flops, to first order)
  collectives   FSDP (fsdp x context): each pass over a layer gathers its weights twice (forward + block remat's
                recompute) and reduce-scatters the trained ones' gradients once, (F-1)/F of the gathered bytes
                each; data-parallel gradient all-reduce, 2 (A-1)/A of the local gradient bytes once per step, over
                data and, for a leaf not split over it, expert; EP all-to-all, `ep_rows` rows of D bf16 per
                layer-token, dispatch + combine in the forward, the recompute and the backward (6 passes),
                (E-1)/E of it leaves the device; TP, 6 all-reduces of D bf16 per layer-token; context, the
                gathered compressed KV (parallel/activations.py) in 3 passes; stage, one [T, n_hc, D] bf16
                stream out and its gradient back per iteration. A group crosses nodes when its axes' devices do
                (devices are stage-major, tensor-minor: sharding/mesh.py), and is then counted at the NIC's
                bandwidth (launch/gpu_target.py NET_BW), else at the node's link bandwidth.
  step          max(compute, HBM) + intra-node bytes / link + inter-node bytes / NIC (added, not overlapped: the
                roofline's convention); tokens/s per GPU = T M / (P tensor) / step.
REMAT_RATIO and HBM_BYTES_PER_FLOP are the seed step's compiled figures (benchmarks/README.md "The learner at Primus
speed": 1.65, 13,521 GiB per 1,334.2 TFLOP, counted with slices through bitcasts as slices), not derived. Tests: tests/launch/test_search.py (tiny config, no compile).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
from collections.abc import Callable

import numpy as np

from dsv4.lora import is_adapter_key
from launch.compile_child import CompileFailed
from launch.gpu_target import NET_BW, Target
from launch.roofline import roofline
from parallel import pipeline
from parallel.activations import context_gathered
from parallel.flops import train_flops_per_token
from parallel.model_bytes import abstract_mesh, local_shape, model_leaves
from parallel.plan import GiB, PlanReport, pipeline_line
from sharding import mesh as mesh_lib
from sharding import rules as rl
from sharding.offload import is_trained

AXES = (rl.STAGE, rl.DATA, rl.FSDP, rl.CONTEXT, rl.EXPERT, rl.TENSOR)  # major -> minor, as sharding/mesh.py
REMAT_RATIO = 1.65  # HLO dot flops / model flops of the seed step (43 layers, padded EP f = 1.25, block remat)
HBM_BYTES_PER_FLOP = 13_521 * GiB / 1_334.2e12  # the seed step's HBM estimate per HLO dot flop
MAX_CONTEXT = 8  # context axes searched: 1 .. 8 (longer rows than the run's need the run's own flags)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One searched layout: its axis sizes, the run's flags for it, the plan's verdict and the step estimate (or
    the compiled roofline, `compiled=True`). Bytes per device per step; seconds per step."""

    sizes: dict[str, int]
    mesh: str
    stages: int
    micro_batches: int
    gib: float
    usable_gib: float
    fits: bool
    bubble: float
    intra: float
    inter: float
    compute_s: float
    memory_s: float
    step_s: float
    tok_s_per_gpu: float
    compiled: bool = False

    @property
    def flags(self) -> str:
        pipe = (f" --learner.pipeline_stages {self.stages} --learner.pipeline_micro_batches {self.micro_batches}"
                if self.stages > 1 else "")  # the run's passes of M micro-batches: the planned GPipe memory
        return f"--mesh {self.mesh}" + pipe

    @property
    def actor(self) -> str:
        return ",".join(f"{a}={self.sizes[a]}" for a in AXES if self.sizes[a] > 1) or "data=1"


def actor_meshes(n: int, config, max_context: int = MAX_CONTEXT) -> list[dict[str, int]]:
    """Every {axis: size} over `AXES` whose sizes multiply to `n` devices, expert dividing the routed experts,
    context <= `max_context` and tensor <= 8 (one node's links; o_groups = 8 on Flash)."""
    divs = [d for d in range(1, n + 1) if n % d == 0]
    out = []
    for combo in itertools.product(divs, repeat=len(AXES) - 1):
        if n % math.prod(combo):
            continue
        sizes = dict(zip(AXES, (*combo, n // math.prod(combo))))
        if config.n_routed_experts % sizes[rl.EXPERT] or sizes[rl.CONTEXT] > max_context or sizes[rl.TENSOR] > 8:
            continue
        out.append(sizes)
    return out


def crosses(axes: tuple[str, ...], sizes: dict[str, int], gpus_per_node: int) -> bool:
    """Whether a collective over the mesh `axes` (each > 1) spans nodes: the devices of an axis are a stride of the
    product of the axes minor to it, so it stays inside a node when that product times its size is <= a node."""
    for a in axes:
        if sizes[a] > 1 and math.prod(sizes[b] for b in AXES[AXES.index(a):]) > gpus_per_node:
            return True
    return False


def ep_rows(config, backend: str, factor: float | None) -> float:
    """Rows the EP all-to-all moves per token and direction: padded / sized with a factor f: min(f k, E); without
    one (dropless): E (the top capacity, the bound the program is compiled for); capacity / ragged: k (x f)."""
    k, e = config.num_experts_per_tok, config.n_routed_experts
    if backend in ("padded", "sized"):
        return min(factor * k, e) if factor else e
    return k * (factor or 1.0)


def weight_bytes(config, sizes: dict[str, int], lora, pipelined: range, trained: Callable[[object], bool]):
    """Per device: (gathered layer weights outside / inside the pipeline (all layers on the device), trained
    gathered bytes outside / inside, the all-reduced gradient bytes x 2 (A-1)/A, summed). Gathered = split over
    expert / tensor / stage only (`parallel.plan`'s g_mesh)."""
    a_mesh = abstract_mesh(sizes)
    g_mesh = abstract_mesh({**sizes, rl.DATA: 1, rl.FSDP: 1, rl.CONTEXT: 1})
    e_mesh = abstract_mesh({rl.EXPERT: sizes[rl.EXPERT]})
    g_out = g_in = t_out = t_in = allreduce = 0.0
    stage = sizes[rl.STAGE]
    for leaf in model_leaves(config, lora):
        item = np.dtype(leaf.dtype).itemsize
        is_layer = leaf.path.startswith("layers.")
        inside = is_layer and int(leaf.path.split(".")[1]) in pipelined
        split = stage if inside else 1
        if is_layer:
            b = math.prod(local_shape(leaf, rl.ACTOR_RULES, g_mesh)) * item / split
            g_in, g_out = (g_in + b, g_out) if inside else (g_in, g_out + b)
            if trained(leaf):
                t_in, t_out = (t_in + b, t_out) if inside else (t_in, t_out + b)
        if trained(leaf):
            expert_split = math.prod(local_shape(leaf, rl.ACTOR_RULES, e_mesh)) < math.prod(leaf.shape)
            a = sizes[rl.DATA] * (1 if expert_split else sizes[rl.EXPERT])
            local = math.prod(local_shape(leaf, rl.ACTOR_RULES, a_mesh)) * item / split
            allreduce += 2 * (a - 1) / a * local
    return g_out, g_in, t_out, t_in, allreduce


def estimate(config, sizes: dict[str, int], *, report: PlanReport, tokens: int, seq: int, micro_batches: int,
             target: Target, gpus_per_node: int, flops_per_token: float, lora=None,
             trained: Callable[[object], bool]) -> Row:
    """The module docstring's arithmetic for the actor mesh `sizes` whose memory plan is `report` (planned with
    `--learner.pipeline_stages` = the stage axis), `tokens` T per device of the batch axes per micro-batch, rows of
    `seq` tokens, M = `micro_batches` (pipelined rows; 1 otherwise; the plan's M too), `flops_per_token` the
    model's (`parallel.flops.train_flops_per_token(config, seq)["total"]`, traced once by the caller). Memory: the
    plan's GPU total (GPipe's M micro-batches of saved stage inputs included). The EP
    dispatch is the plan's (`report.options`: the resolved `ep_backend`, `ep_capacity_factor`)."""
    ep_backend, ep_factor = report.options["ep_backend"], report.options["ep_capacity_factor"]
    p, t, c = sizes[rl.STAGE], sizes[rl.TENSOR], sizes[rl.CONTEXT]
    pipe = pipeline_line(config, p, p, micro_batches)
    pipelined = range(0) if pipe is None else pipe[1]
    m = micro_batches if p > 1 else 1
    n_layers = config.num_hidden_layers
    lp = len(pipelined)
    lo = n_layers - lp
    iters = m + p - 1
    layer_tokens = tokens * (m * lo / p + iters * lp / p)
    flops = layer_tokens / n_layers * flops_per_token / t * REMAT_RATIO
    compute_s = flops / target.peak_flops
    memory_s = flops * HBM_BYTES_PER_FLOP / target.hbm_bw
    g_out, g_in, t_out, t_in, allreduce = weight_bytes(config, sizes, lora, pipelined, trained)
    intra = inter = 0.0

    def add(b: float, axes: tuple[str, ...]) -> None:
        nonlocal intra, inter
        if crosses(axes, sizes, gpus_per_node):
            inter += b
        else:
            intra += b

    f = sizes[rl.FSDP] * c
    if f > 1:  # per pass over the layers: 2 all-gathers + 1 reduce-scatter of the trained ones
        add((f - 1) / f * (2 * (m * g_out + iters * g_in) + (m * t_out + iters * t_in)), (rl.FSDP, rl.CONTEXT))
    add(allreduce, (rl.DATA, rl.EXPERT))
    e = sizes[rl.EXPERT]
    if e > 1:
        add(layer_tokens * ep_rows(config, ep_backend, ep_factor) * config.hidden_size * 2 * 6 * (e - 1) / e,
            (rl.EXPERT,))
    if t > 1:
        add(layer_tokens * 6 * config.hidden_size * 2 * 2 * (t - 1) / t, (rl.TENSOR,))
    if c > 1:
        add(layer_tokens / tokens * context_gathered(config, sizes, tokens, seq) * 3 * (c - 1) / c, (rl.CONTEXT,))
    if p > 1:
        add(2 * iters * tokens * config.hc_mult * config.hidden_size * 2, (rl.STAGE,))
    step_s = max(compute_s, memory_s) + intra / target.link_bw + inter / NET_BW
    a = report.actor
    return Row(sizes=sizes, mesh=report.mesh_spec, stages=p, micro_batches=m, gib=a.gpu_total / GiB,
               usable_gib=a.usable / GiB, fits=a.fits, bubble=pipeline.bubble_fraction(p, m),
               intra=intra, inter=inter, compute_s=compute_s, memory_s=memory_s, step_s=step_s,
               tok_s_per_gpu=tokens * m / (p * t) / step_s)


def mesh_spec(sizes: dict[str, int], rollout: dict[str, int] | None) -> str:
    """The run's `--mesh` for actor axes `sizes` and the rollout's axes (None: colocated)."""
    actor = ",".join(f"{a}={sizes[a]}" for a in AXES if sizes[a] > 1) or "data=1"
    if rollout is None:
        return f"actor:{actor}"
    return f"actor:{actor}/rollout:" + (",".join(f"{a}={s}" for a, s in rollout.items() if s > 1) or "data=1")


def table(rows: list[Row], title: str) -> str:
    """The search table, rows as given (sorted by the caller)."""
    head = (f"{'#':>3} {'actor mesh':<34}{'tok/s/GPU':>10}{'step s':>8}{'GiB':>8}{'fits':>5}{'bubble':>7}"
            f"{'intra GiB':>10}{'inter GiB':>10}  flags")
    lines = [title, head]
    for i, r in enumerate(rows, 1):
        lines.append(f"{i:>3} {r.actor:<34}{r.tok_s_per_gpu:>10,.0f}{r.step_s:>8.4g}{r.gib:>8.1f}"
                     f"{'yes' if r.fits else 'no':>5}{r.bubble:>7.3f}{r.intra / GiB:>10.1f}{r.inter / GiB:>10.1f}  "
                     f"{r.flags}")
    return "\n".join(lines)


def search(config, *, n_actor: int, rollout: dict[str, int] | None, plan_fn: Callable[[str, int], PlanReport],
           tokens_fn: Callable[[str], int], seq: int, micro_batches: int | None, target: Target, gpus_per_node: int,
           lora, trained: Callable[[object], bool], say=print) -> list[Row]:
    """The arithmetic table of every actor mesh of `n_actor` devices (module docstring), printed and returned
    sorted by estimated tokens/s per GPU (fitting rows first). `plan_fn(mesh, stages)`: the run's memory plan for
    that mesh and `--learner.pipeline_stages`; `tokens_fn(mesh)`: tokens per device of the batch axes; M for a
    pipelined row: `micro_batches` or 4 P. Layouts the model or learner cannot take are dropped (counted by
    reason)."""
    rows, dropped = [], {}
    flops_per_token = train_flops_per_token(config, seq)["total"]  # an nnx.eval_shape of the model: once
    for sizes in actor_meshes(n_actor, config):
        spec = mesh_spec(sizes, rollout)
        p = sizes[rl.STAGE]
        try:
            report = plan_fn(spec, p)
            row = estimate(config, sizes, report=report, tokens=tokens_fn(spec), seq=seq,
                           micro_batches=micro_batches or 4 * p, target=target, gpus_per_node=gpus_per_node,
                           flops_per_token=flops_per_token, lora=lora, trained=trained)
        except ValueError as e:  # MeshSpecError: a dim the mesh does not divide; the pipeline's stage count
            why = str(e).split(" (parameter")[0][:90]
            dropped[why] = dropped.get(why, 0) + 1
            continue
        rows.append(row)
    rows.sort(key=lambda r: (not r.fits, -r.tok_s_per_gpu))
    n_fit = sum(r.fits for r in rows)
    say(table(rows, f"search: {len(rows)} actor meshes of {n_actor} devices ({gpus_per_node} per node), {n_fit} fit "
                    f"by the plan arithmetic; ranked by the arithmetic estimate (launch/search.py) on "
                    f"{target.label}"))
    if dropped:
        say("  dropped (the model or the learner cannot take them): "
            + "; ".join(f"{n} x {why}" for why, n in sorted(dropped.items(), key=lambda kv: -kv[1])))
    return rows


def compiled_row(row: Row, xla, *, usable: float, seq: int, n_actor: int, target: Target) -> Row:
    """`row` with the compiled step's figures: XLA:GPU's memory (`xla.total`, a `launch.aot.CompileReport`) against
    `usable` bytes, its HLO roofline (launch/roofline.py) and tokens/s per GPU = rows x seq / actor devices / step."""
    r = roofline(xla.hlo, target)
    return dataclasses.replace(row, gib=xla.total / GiB, usable_gib=usable / GiB, fits=xla.total <= usable,
                               intra=xla.hlo.intra, inter=xla.hlo.inter, compute_s=r.compute_s,
                               memory_s=r.memory_s, step_s=r.step_s,
                               tok_s_per_gpu=xla.rows * seq / n_actor / r.step_s, compiled=True)


def compile_best(rows: list[Row], n: int, compile_fn: Callable[[Row], Row | None], say=print) -> list[Row]:
    """Compile the `n` best rows that fit by the arithmetic (`compile_fn(row)` -> the compiled Row, or None when
    it failed: its error already printed), print their table ranked by the compiled roofline and return it."""
    done = []
    for row in [r for r in rows if r.fits][:n]:
        out = compile_fn(row)
        if out is not None:
            done.append(out)
    done.sort(key=lambda r: (not r.fits, -r.tok_s_per_gpu))
    if done:
        say(table(done, f"search: the {len(done)} best compiled (XLA:GPU, deviceless), ranked by the HLO roofline "
                        "(memory: XLA's; bytes: the HLO's collectives)"))
    return done


def run(config, *, mesh: str, nodes: int | None, gpus_per_node: int, learner, seq: int, peaks: Target,
        target: Target | None, n_compile: int, micro_batches: int | None, plan_fn, compile_fn, tokens_fn,
        say=print) -> int:
    """`python -m launch.plan --search` (module docstring) for the run's `mesh` (its rollout part kept) on `nodes`
    (None: the mesh's) x `gpus_per_node`, with `learner` (`rl.config.algo.LearnerConfig`) and rows of `seq` tokens;
    `peaks`: the roofline's target; `target`: the compile's (None: no compile). Callables: `plan_fn(mesh, learner)`
    -> PlanReport; `compile_fn(report, learner)` -> `launch.aot.CompileReport` (raises ValueError /
    CompileFailed); `tokens_fn(mesh)` -> tokens per device of the batch axes. Prints the tables and, last,
    `RESULT search_meshes=.. search_fit=.. best_mesh=.. compiled=yes|no actor_tok_s_per_gpu_roofline=..
    actor_gpu_gib=.. fits=yes|no` (best: the top compiled row, else the top fitting arithmetic row). Returns 0;
    raises ValueError (one line, naming the flag) for bad input."""
    if gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
    spec = mesh_lib.parse_mesh_spec(mesh)
    rollout = None if spec.colocated else spec.axes(rl.ROLLOUT)
    total = spec.n_devices if nodes is None else nodes * gpus_per_node
    n_actor = total - (0 if rollout is None else spec.size(rl.ROLLOUT))
    if n_actor < 1:
        raise ValueError(f"--nodes {nodes} x --gpus-per-node {gpus_per_node} leaves no device for the actor")
    lora = learner.lora if learner.lora.enabled else None

    def trained(leaf) -> bool:  # what gets a gradient: parallel.plan's rule
        if lora is not None:
            return is_adapter_key(leaf.path.replace(".", "/"))
        return leaf.trained and is_trained(leaf.path, train_mtp=learner.train_mtp, freeze_router=learner.freeze_router)

    def staged(stages: int):
        return dataclasses.replace(learner, pipeline_stages=stages)

    rows = search(config, n_actor=n_actor, rollout=rollout, plan_fn=lambda m, p: plan_fn(m, staged(p)),
                  tokens_fn=tokens_fn, seq=seq, micro_batches=micro_batches, target=peaks,
                  gpus_per_node=gpus_per_node, lora=lora, trained=trained, say=say)

    def one(row: Row) -> Row | None:
        report = plan_fn(row.mesh, staged(row.stages))
        try:
            xla = compile_fn(report, staged(row.stages))
        except (ValueError, CompileFailed) as e:  # the learner's, or XLA's (one line each): the next row
            print(f"error: {row.flags}: {e}", file=sys.stderr)
            return None
        say(f"  compiled {row.flags}: {xla.total / GiB:.2f} GiB per device in {xla.compile_s:.0f} s")
        return compiled_row(row, xla, usable=report.actor.usable, seq=seq, n_actor=n_actor, target=target)

    done = compile_best(rows, n_compile, one, say=say) if target is not None and n_compile > 0 else []
    if target is None:
        say("  (no compile: --search compiles on a GPU --target only)")
    best = (done or [r for r in rows if r.fits] or rows or [None])[0]
    nan = float("nan")
    say(f"RESULT search_meshes={len(rows)} search_fit={sum(r.fits for r in rows)} "
        f"best_mesh={'none' if best is None else best.actor} compiled={'yes' if done else 'no'} "
        f"actor_tok_s_per_gpu_roofline={nan if best is None else best.tok_s_per_gpu:.0f} "
        f"actor_gpu_gib={nan if best is None else best.gib:.2f} fits={'yes' if best and best.fits else 'no'}")
    return 0
