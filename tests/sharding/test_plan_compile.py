"""python -m launch.plan --compile (launch/aot.py): the real actor train step AOT-compiled for a mesh with abstract
parameters. XLA's per-device argument bytes are exactly the planner's state arithmetic (weights + fp32 masters +
moments on the device, offloaded state subtracted) plus the batch and a few scalars; the CLI prints the RESULT
line. Tiny config, short rows: each compile takes seconds.
Run: `.venv/bin/python -m pytest -q tests/sharding/test_plan_compile.py`.
"""

import dataclasses
import math

import dsv4
from dsv4.lora import LoraConfig
from launch import compile_child
from launch import plan as plan_mod
from launch.aot import compile_actor, reduced_depth
from parallel import plan as pl
from launch.plan import main as plan_main
from rl.config.algo import LearnerConfig
from rl.config.run import DEFAULT_LEARNER

GiB = 2**30
MESH = "actor:fsdp=2,expert=2/rollout:expert=2"


def test_xla_arguments_equal_the_planned_state():
    """offload 0.5 with the default learner's frozen MTP: argument bytes - batch bytes - scalars == plan's
    weights + gradients-free state (weights, masters and moments on the device) + the offloaded bytes, which
    XLA:CPU counts as arguments (the report subtracts them)."""
    cfg = reduced_depth(dsv4.DSV4Config.tiny(), 2)
    assert cfg.num_hidden_layers == 2 and len(cfg.compress_ratios) == 3
    seq = 16
    learner = dataclasses.replace(DEFAULT_LEARNER, offload_optimizer=0.5)
    xla = compile_actor(cfg, MESH, seq_len=seq, learner=learner)
    report = pl.plan(cfg, MESH, "h200", learner=learner, tokens_per_device=seq,
                     train_seq_len=seq)
    items = report.actor.items
    state = sum(v for k, v in items.items() if not k.startswith(("gradients", "activations", "optimizer update")))
    rows_per_device = xla.rows // 4  # batch over fsdp x expert, split in blocks
    batch = rows_per_device * seq * (4 * 4 + cfg.num_hidden_layers * cfg.num_experts_per_tok * 4) + rows_per_device * 4
    scalars = xla.argument - batch - state - report.actor.host
    assert 0 <= scalars <= 64, scalars  # step and Adam counts (int32)
    assert xla.host == report.actor.host > 0
    assert xla.temp > 0 and xla.total == xla.argument + xla.output - xla.alias + xla.temp - xla.host


def test_lora_actor_arguments_are_the_frozen_base_and_the_adapters_state():
    """LoRA (issue 40): the planner compiles the LoRA actor step (the model carries the adapters; it raised before).
    XLA's argument bytes are the plan's: the frozen bf16 base and the float32 adapters, Adam moments for the adapters
    alone and no master copy, plus the batch and a few scalars."""
    cfg = reduced_depth(dsv4.DSV4Config.tiny(), 2)
    seq = 16
    learner = dataclasses.replace(DEFAULT_LEARNER, lora=LoraConfig(rank=4, targets="attn,shared,head"))
    xla = compile_actor(cfg, MESH, seq_len=seq, learner=learner)
    report = pl.plan(cfg, MESH, "h200", learner=learner, tokens_per_device=seq, train_seq_len=seq)
    items = report.actor.items
    assert items["fp32 master weights"] == 0 and 0 < items["Adam moments (2 x fp32)"] < items[
        "weights (bf16; fp32 mHC/sinks/ape/bias; int32 tid2eid)"]
    state = sum(v for k, v in items.items() if not k.startswith(("gradients", "activations", "optimizer update")))
    rows_per_device = xla.rows // 4
    batch = rows_per_device * seq * (4 * 4 + cfg.num_hidden_layers * cfg.num_experts_per_tok * 4) + rows_per_device * 4
    assert 0 <= xla.argument - batch - state <= 64, xla.argument - batch - state  # step and Adam counts (int32)


def test_cli_compile_prints_the_result_line(capfd):
    """The CLI compiles both programs and prints its RESULT line; neither program makes XLA's SPMD partitioner
    replicate a whole tensor ("Involuntary full rematerialization", logged on stderr: the embedding lookup from the
    FSDP-split table did, issue 24)."""
    # the run's flags: rows of 16 + 32 = 48 tokens, two per device; 4 x 2 rollout sequences; MTP trained too (the
    # tiny step's state reaches 0.01 GiB)
    argv = ["--config", "tiny", "--mesh", MESH, "--gpu", "mi308x", "--compile", "--max-prompt-len", "16",
            "--max-new-tokens", "32", "--max-tokens-per-micro-batch", "96", "--num-layers", "2",
            "--prompts-per-step", "4", "--group-size", "2", "--learner.train_mtp"]
    assert plan_main(argv) == 0
    out, err = capfd.readouterr()
    assert "Involuntary full rematerialization" not in err
    last = out.strip().splitlines()[-1]
    fields = dict(kv.split("=", 1) for kv in last.split()[1:])
    assert last.startswith("RESULT ") and list(fields) == [
        "actor_xla_gib", "actor_plan_gib", "actor_usable_gib", "rollout_xla_gib", "rollout_plan_gib",
        "rollout_usable_gib", "fits"]
    # issue 13: the rollout's generate program is compiled too (it was "nan" before)
    assert float(fields["rollout_xla_gib"]) >= 0 and fields["fits"] == "yes"
    assert "rollout generate program" in out and "KV capacity left" in out
    assert float(fields["actor_usable_gib"]) == 192 * 0.9 and float(fields["actor_xla_gib"]) > 0
    assert "reduced to 2 layers" in out and "8 rows x 48 tokens" in out and "XLA:CPU upcasts bf16" in out
    assert math.isfinite(float(fields["actor_plan_gib"])) and math.isfinite(float(fields["rollout_xla_gib"]))


def test_padded_ep_compiles_without_ragged_dot_temporaries():
    """The padded EP backend (per-expert capacity buffers, batched dense matmuls) needs less temp memory than the
    dropless capacity backend, whose `ragged_dot` XLA:CPU expands densely over the local experts; the plan's
    arithmetic follows the backend (fewer EP rows) and the optimizer-update transient is the offloaded state."""
    cfg = reduced_depth(dsv4.DSV4Config.tiny(), 2)
    seq = 32
    cap = compile_actor(cfg, MESH, seq_len=seq, learner=dataclasses.replace(DEFAULT_LEARNER, ep_backend="capacity"))
    pad = compile_actor(cfg, MESH, seq_len=seq, learner=dataclasses.replace(DEFAULT_LEARNER, ep_backend="padded",
                                                                            ep_capacity_factor=1.0))
    assert pad.argument == cap.argument and pad.temp < cap.temp
    plans = {b: pl.plan(cfg, MESH, "h200", tokens_per_device=seq, train_seq_len=seq,
                        learner=LearnerConfig(ep_backend=b, ep_capacity_factor=1.0 if b == "padded" else None,
                                              offload_optimizer=0.5, stream_optimizer=False))
             for b in ("capacity", "padded")}
    act = {b: next(v for k, v in p.actor.items.items() if k.startswith("activations")) for b, p in plans.items()}
    assert act["padded"] < act["capacity"]
    assert plans["padded"].actor.items["optimizer update: offloaded state moved to the device (learner's step)"] \
        == plans["padded"].actor.host > 0


def test_cli_compile_only_rollout_continuous_batching(capsys):
    """--compile-only rollout: the continuous-batching program (3 slots -> 4, a multiple of the 2 batch shards;
    per-request prefill in chunks of 8) compiled alone; the actor's XLA field is nan; bad --rollout-slots named."""
    argv = ["--config", "tiny", "--mesh", MESH, "--gpu", "mi308x", "--compile", "--compile-only", "rollout",
            "--num-layers", "2", "--prompts-per-step", "3", "--group-size", "2", "--max-prompt-len", "20",
            "--max-new-tokens", "28", "--rollout-slots", "3", "--prefill-chunk", "8"]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    fields = dict(kv.split("=", 1) for kv in out.strip().splitlines()[-1].split()[1:])
    assert math.isnan(float(fields["actor_xla_gib"])) and float(fields["rollout_xla_gib"]) >= 0
    assert "continuous batching over 4 slots (2 per device), per-request prefill in chunks of 8" in out
    assert "XLA memory analysis of the actor" not in out
    assert plan_main(argv[:-4] + ["--rollout-slots", "many"]) == 2
    err = capsys.readouterr().err
    assert "--rollout-slots" in err and "'many'" in err


def test_cli_compile_abort_is_one_line_and_the_context_actor_compiles(capfd, monkeypatch):
    """Issue 42: each compile runs in a child process. The rollout's child aborts here (SIGABRT, as XLA's failed
    CHECKs do): one `error:` line naming the role, the target and what to try, no C++ stack, exit 1, and the actor's
    program is still compiled and printed. The actor is the bf16 context-parallel step (a CSA layer on
    fsdp=2,expert=2,context=2), which aborted XLA:CPU before dsv4/context.py psummed only float32."""
    real = compile_child.compile_in_child

    def rollout_aborts(job, **kw):
        if kw["role"] == "rollout":
            job = compile_child.Job("faulthandler:_sigabrt", {})
        return real(job, **kw)

    monkeypatch.setattr(plan_mod, "compile_in_child", rollout_aborts)
    argv = ["--config", "tiny", "--mesh", "actor:fsdp=2,expert=2,context=2/rollout:expert=8", "--gpu", "mi308x",
            "--compile", "--max-prompt-len", "16", "--max-new-tokens", "32", "--num-layers", "2",
            "--prompts-per-step", "4", "--group-size", "2"]
    assert plan_main(argv) == 1
    out, err = capfd.readouterr()
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: the rollout compile (XLA:CPU, --target cpu) aborted "
                                                     "inside XLA (killed by SIGABRT); try a GPU --target"), err
    assert "--compile-only actor" in errors[0] and "Check failure" not in err and "Fatal Python" not in err
    assert "XLA memory analysis of the actor train step" in out and "rollout generate program" not in out
    fields = dict(kv.split("=", 1) for kv in out.strip().splitlines()[-1].split()[1:])
    assert not math.isnan(float(fields["actor_xla_gib"])) and math.isnan(float(fields["rollout_xla_gib"]))
