"""The Flash seed layout's verdict from XLA:GPU (issue 24): `python -m launch.plan --config-file
launch/configs/dapo_seed_mi308x.yaml --compile --target ...` for both roles, one planner process per row.

Rows, in this order (each prints its own `RESULT target=..` line; the last line repeats the seed row's):
  seed_mi308x:     the seed run as shipped on the MI308X-sized target (proxy: H200 spec with 192 GiB), all 43
                   layers;
  seed_mi355x_4x8: the seed run's knobs on 4 x 8 MI355X (proxy: B200 spec with 288 GiB), the actor on nodes 0-1 in
                   the layout `launch.plan --search` picked there (two pipeline stages across the nodes, expert=8
                   in each, 16 micro-batches per pass: issue 38), rollout data=2 x expert=8 on nodes 2-3;
  cpu_4l / gpu_4l: the seed run at 4 layers, XLA:CPU (its HLO with the MI308X peaks) beside XLA:GPU (MI308X proxy):
                   the CPU artefacts quantified.
The rollout regime is the seed config's (64 prompts x 16 samples = 1,024 sequences of 1,024 + 8,192 tokens, FP8
weights and KV cache, continuous batching over the slots the KV budget holds, dropless "sized" expert dispatch);
`--max-new-tokens 31744` (a run flag on top of the file: 1,024 + 31,744 tokens) gives the 32K regime; other
planner and run flags pass through (e.g. `--rollout.ep_capacity_factor 2`, `--compile-only rollout`). Flash compiles take
minutes each (flat in depth: scanned layers) and several GB of RAM: rows run one at a time.

`--context` runs the long-context rows of issue 25 instead (`CONTEXT_ROWS`: the actor with context parallelism
at 32K tokens per row on the seed's 16 actor devices and at 64K on 4 x 8 MI355X, the seed rollout at 64K tokens per
sequence, the rollout program's chunked prefill of a 16K and a 64K prompt); its last line is
`RESULT cp_flash_32k_seed_gib=.. cp_flash_64k_mi355x_gib=.. rollout_64k_seed_gib=.. rollout_64k_slots_per_device=..
prefill_temp_gib_16k=.. prefill_temp_gib_64k=.. prefill_temp_ratio_64k_16k=.. fits=yes|no` (GiB per device, XLA:GPU;
fits: every row's program within its usable memory).

Needs the [gpu-aot] extra (the CUDA plugin). Run:
    .venv/bin/python benchmarks/gpu_plan.py                     (all rows; ~25-40 min on 2 busy cores)
    .venv/bin/python benchmarks/gpu_plan.py --rows gpu_4l cpu_4l
    .venv/bin/python benchmarks/gpu_plan.py --context           (the issue-25 rows; ~15-20 min on 2 busy cores)
Last line: `RESULT target=.. actor_gpu_gib=.. actor_usable_gib=.. rollout_gpu_gib=.. actor_step_s_roofline=..
actor_tok_s_per_gpu_roofline=.. rollout_tok_s_roofline=.. remat_flops_ratio=.. decode_step_ms_roofline=.. decode_step_ms_limit=..
decode_bytes_x_weights=.. fp8_gemm_byte_share=.. expert_flops_x_routed=.. fits=yes|no` (for a CPU row
actor_gpu_gib / rollout_gpu_gib hold XLA:CPU's figures).
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import re
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
SEED = REPO / "launch" / "configs" / "dapo_seed_mi308x.yaml"
ROWS = {
    "seed_mi308x": ["--target", "mi308x"],
    "seed_mi355x_4x8": ["--target", "mi355x", "--mesh", "actor:stage=2,expert=8/rollout:data=2,expert=8",
                        "--learner.pipeline_stages", "2", "--learner.pipeline_micro_batches", "16"],
    "gpu_4l": ["--target", "mi308x", "--num-layers", "4"],
    "cpu_4l": ["--target", "cpu", "--gpu", "mi308x", "--num-layers", "4"],
}
# --context (issue 25): long-context rows, all 43 layers unless said. The actor at 32K tokens per row on the seed's
# 16 actor devices (context 4: 8K tokens per device) and at 64K on 4 x 8 MI355X (context 8); the seed rollout with
# 64K tokens per sequence (1,024 prompt + 64,512 new, slots auto); the rollout program with 16K and 64K prompts
# (4 layers: sliding, sliding, CSA, HCA; one slot per device, chunked prefill in chunks of --prefill-chunk 2048):
# its temporaries are the chunk's, not the prompt's. Lengths are the run's: --max-prompt-len + --max-new-tokens.
_PREFILL = ["--target", "mi308x", "--num-layers", "4", "--compile-only", "rollout", "--prompts-per-step", "4",
            "--group-size", "2", "--rollout-slots", "8", "--max-new-tokens", "1024"]
CONTEXT_ROWS = {
    "cp_32k_seed": ["--target", "mi308x", "--mesh", "actor:fsdp=2,context=4,expert=2/rollout:expert=8",
                    "--max-new-tokens", "31744", "--compile-only", "actor"],
    "cp_64k_mi355x": ["--target", "mi355x", "--gpu", "mi355x", "--nodes", "5", "--mesh",
                      "actor:fsdp=2,context=8,expert=2/rollout:expert=8", "--max-new-tokens", "64512",
                      "--compile-only", "actor"],
    "rollout_64k_seed": ["--target", "mi308x", "--max-new-tokens", "64512", "--compile-only", "rollout"],
    "prefill_16k": [*_PREFILL, "--max-prompt-len", "16384"],
    "prefill_64k": [*_PREFILL, "--max-prompt-len", "65536"],
}
ROWS.update(CONTEXT_ROWS)
FIELDS = ("target", "actor_gpu_gib", "actor_usable_gib", "rollout_gpu_gib", "actor_step_s_roofline",
          "actor_tok_s_per_gpu_roofline", "rollout_tok_s_roofline", "remat_flops_ratio", "decode_step_ms_roofline", "decode_step_ms_limit",
          "decode_bytes_x_weights", "fp8_gemm_byte_share", "expert_flops_x_routed", "fits")


def _fields(line: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in line.split("RESULT", 1)[-1].split() if "=" in kv)


def run_row(name: str, extra: list[str], log_dir: pathlib.Path) -> str:
    """One planner run -> its RESULT line in the issue's fields (a CPU row's XLA:CPU figures in the gpu fields);
    the planner's whole output is kept in `log_dir`/NAME.log."""
    argv = [sys.executable, "-m", "launch.plan", "--config-file", str(SEED), "--compile", *ROWS[name], *extra]
    t0 = time.perf_counter()
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env={**os.environ})
    (log_dir / f"{name}.log").write_text(out.stdout + out.stderr)
    lines = out.stdout.strip().splitlines()
    res = next((ln for ln in reversed(lines) if ln.startswith("RESULT ")), "")
    roof = next((ln for ln in reversed(lines) if "ROOFLINE " in ln), "")
    if out.returncode or not res:
        print(f"{name}: exit {out.returncode}; see {log_dir / (name + '.log')}", file=sys.stderr)
        return f"RESULT target={name} " + " ".join(f"{k}=nan" for k in FIELDS[1:-1]) + " fits=no"
    r, f = _fields(res), _fields(roof.split("ROOFLINE", 1)[-1])
    if "target" not in r:  # the XLA:CPU row: its own RESULT fields, the roofline line beside it
        r = {"target": "cpu", "actor_gpu_gib": r["actor_xla_gib"], "actor_usable_gib": r["actor_usable_gib"],
             "rollout_gpu_gib": r["rollout_xla_gib"], "actor_step_s_roofline": f.get("actor_step_s", "nan"),
             "rollout_tok_s_roofline": f.get("rollout_tok_s", "nan"),
             "remat_flops_ratio": f.get("remat_flops_ratio", "nan"), "fits": r["fits"]}
    line = "RESULT " + " ".join(f"{k}={r.get(k, 'nan')}" for k in FIELDS)
    print(f"# {name} ({time.perf_counter() - t0:.0f} s): {line}", flush=True)
    return line


def _rollout_figures(log: str) -> tuple[float, float, int]:
    """(temporaries GiB, total GiB, slots per device) of the rollout program in a planner log (nan / 0: absent)."""
    temp = re.search(r"temporaries \(activations[^)]*\)\s+([\d.]+)", log)
    total = re.findall(r"total on the device\s+([\d.]+)", log)
    slots = re.search(r"continuous batching over \d+ slots \((\d+) per device\)", log)
    return (float(temp.group(1)) if temp else math.nan, float(total[-1]) if total else math.nan,
            int(slots.group(1)) if slots else 0)


def context_result(lines: dict[str, str], log_dir: pathlib.Path) -> str:
    """The `--context` rows' RESULT line (issue 25 points 2-3): the two actors' XLA:GPU GiB per device, the 64K
    rollout's GiB and slots per device, the rollout program's temporaries at a 16K and a 64K prompt; fits = every
    compiled program within its usable memory."""
    f = {name: _fields(line) for name, line in lines.items()}
    logs = {name: (log_dir / f"{name}.log").read_text() for name in lines}
    r_temp, r_total, r_slots = _rollout_figures(logs.get("rollout_64k_seed", ""))
    t16 = _rollout_figures(logs.get("prefill_16k", ""))[0]
    t64 = _rollout_figures(logs.get("prefill_64k", ""))[0]
    get = lambda row, k: f.get(row, {}).get(k, "nan")  # noqa: E731
    fits = all(f[row].get("fits") == "yes" for row in f)
    return (f"RESULT cp_flash_32k_seed_gib={get('cp_32k_seed', 'actor_gpu_gib')} "
            f"cp_flash_64k_mi355x_gib={get('cp_64k_mi355x', 'actor_gpu_gib')} rollout_64k_seed_gib={r_total:.2f} "
            f"rollout_64k_slots_per_device={r_slots} prefill_temp_gib_16k={t16:.2f} prefill_temp_gib_64k={t64:.2f} "
            f"prefill_temp_ratio_64k_16k={t64 / t16:.3f} fits={'yes' if fits else 'no'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=None,
                   help="rows to run (default: the issue-24 rows, or with --context the long-context rows)")
    p.add_argument("--context", action="store_true",
                   help="the long-context rows (issue 25): last line `RESULT cp_flash_32k_seed_gib=.. ...`")
    p.add_argument("--log-dir", default="/tmp/gpu_plan_logs", help="each row's full planner output")
    args, extra = p.parse_known_args()
    rows = args.rows or [r for r in ROWS if (r in CONTEXT_ROWS) == args.context]
    log_dir = pathlib.Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    lines = [(name, run_row(name, extra, log_dir)) for name in rows]
    for name, line in lines:
        print(f"{name}: {line}")
    if args.context:
        print(context_result(dict(lines), log_dir))
    else:
        print(dict(lines).get("seed_mi308x", lines[-1][1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
