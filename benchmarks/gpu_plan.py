"""The Flash seed layout's verdict from XLA:GPU (issue 24): `python -m launch.plan --config-file
launch/configs/dapo_seed_mi308x.yaml --compile --target ...` for both roles, one planner process per row.

Rows, in this order (each prints its own `RESULT target=..` line; the last line repeats the seed row's):
  seed_mi308x:     the seed run as shipped on the MI308X-sized target (proxy: H200 spec with 192 GiB), all 43
                   layers;
  seed_mi355x_4x8: the seed run's knobs on 4 x 8 MI355X (proxy: B200 spec with 288 GiB), actor fsdp=2 x expert=8
                   on nodes 0-1, rollout data=2 x expert=8 on nodes 2-3;
  cpu_4l / gpu_4l: the seed run at 4 layers, XLA:CPU (its HLO with the MI308X peaks) beside XLA:GPU (MI308X proxy):
                   the CPU artefacts quantified.
The rollout regime is the seed config's (64 prompts x 16 samples = 1,024 sequences of 1,024 + 8,192 tokens, FP8
weights and KV cache, continuous batching over the slots the KV budget holds, dropless padded expert dispatch);
`--rollout-context 32768` (flag on top of the file) gives the 32K regime; other planner flags pass through (e.g.
`--rollout-ep-capacity-factor 2`, `--compile-only rollout`). Flash compiles take
minutes each (flat in depth: scanned layers) and several GB of RAM: rows run one at a time.

Needs the [gpu-aot] extra (the CUDA plugin). Run:
    .venv/bin/python benchmarks/gpu_plan.py                     (all rows; ~25-40 min on 2 busy cores)
    .venv/bin/python benchmarks/gpu_plan.py --rows gpu_4l cpu_4l
Last line: `RESULT target=.. actor_gpu_gib=.. actor_usable_gib=.. rollout_gpu_gib=.. actor_step_s_roofline=..
rollout_tok_s_roofline=.. remat_flops_ratio=.. fits=yes|no` (for a CPU row actor_gpu_gib / rollout_gpu_gib hold
XLA:CPU's figures).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
SEED = REPO / "launch" / "configs" / "dapo_seed_mi308x.yaml"
ROWS = {
    "seed_mi308x": ["--target", "mi308x"],
    "seed_mi355x_4x8": ["--target", "mi355x", "--mesh", "actor:fsdp=2,expert=8/rollout:data=2,expert=8"],
    "gpu_4l": ["--target", "mi308x", "--num-layers", "4"],
    "cpu_4l": ["--target", "cpu", "--gpu", "mi308x", "--num-layers", "4"],
}
FIELDS = ("target", "actor_gpu_gib", "actor_usable_gib", "rollout_gpu_gib", "actor_step_s_roofline",
          "rollout_tok_s_roofline", "remat_flops_ratio", "fits")


def _fields(line: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in line.split("RESULT", 1)[-1].split() if "=" in kv)


def run_row(name: str, extra: list[str], log_dir: pathlib.Path) -> str:
    """One planner run -> its RESULT line in the issue's fields (a CPU row's XLA:CPU figures in the gpu fields)."""
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
    line = "RESULT " + " ".join(f"{k}={r[k]}" for k in FIELDS)
    print(f"# {name} ({time.perf_counter() - t0:.0f} s): {line}", flush=True)
    return line


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    p.add_argument("--log-dir", default="/tmp/gpu_plan_logs", help="each row's full planner output")
    args, extra = p.parse_known_args()
    log_dir = pathlib.Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    lines = [(name, run_row(name, extra, log_dir)) for name in args.rows]
    for name, line in lines:
        print(f"{name}: {line}")
    print(dict(lines).get("seed_mi308x", lines[-1][1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
