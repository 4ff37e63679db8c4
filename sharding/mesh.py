"""Mesh specs and the MeshPlan: which devices the actor (training) and rollout (sampling) roles get.

A run has two roles in one JAX program (house rule 9): the BF16 *actor* mesh that trains and the FP8
*rollout* mesh that samples, on disjoint devices, or on the same devices when colocated. Both meshes have
the six axes `(stage, data, fsdp, context, expert, tensor)` in that order (major to minor, `tensor` innermost so TP
peers are neighbouring devices, `stage` outermost); an axis left out of a spec has size 1. Placement inside a mesh is
decided by the role's rule table in `sharding/rules.py`.

Spec grammar (also accepted by `launch/run.py --mesh`):

    SPEC   := "auto" | ROLE ("/" ROLE)?
    ROLE   := ("actor" | "rollout") ":" AXIS ("," AXIS)*
    AXIS   := ("stage" | "data" | "fsdp" | "context" | "expert" | "tensor") "=" INT>=1

    actor:fsdp=2,expert=2/rollout:expert=2,tensor=2   actor on devices 0-3, rollout on 4-7
    actor:fsdp=4                                     colocated: rollout mesh IS the actor mesh
    actor:fsdp=2,expert=2,context=2                  context parallelism: the sequence split in two
    actor:stage=2,fsdp=2,expert=2                    pipeline parallelism: the layers in two stages
    auto                                             the rule below, for the devices present

Devices are taken in `jax.devices()` order (process-major on multi-host runs): the actor gets the first
`prod(actor sizes)`, the rollout the next `prod(rollout sizes)`; leftover devices stay unused.

`auto` with n devices (powers of two, as large as fit, every device used when n is a power of two):
  * n == 1: colocated, both roles on the one device.
  * otherwise the actor gets a = n/2 if n is a power of two, else a = the largest power of two below n;
    the rollout gets r = the largest power of two <= n - a. (8 -> 4+4, 6 -> 4+2, 12 -> 8+4, 2 -> 1+1.)
  * actor (FSDP + EP): with a = 2^k, expert = 2^ceil(k/2), fsdp = 2^floor(k/2)   (4 -> fsdp=2,expert=2).
  * rollout (EP + TP): with r = 2^k, tensor = min(2^floor(k/2), 8), expert = r / tensor  (4 -> expert=2,tensor=2).
  So 8 devices -> `actor:fsdp=2,expert=2/rollout:expert=2,tensor=2`. Why: mesh sizes that are powers of two
  divide the model's power-of-two dims (experts 256, heads 64, hidden 4096); the actor gets the larger half
  of an uneven count because it also holds fp32 master weights and optimizer state; TP is capped at 8
  (one node's fast links, and o_groups=8 on DeepSeek-V4-Flash).

Errors are `MeshSpecError` (a ValueError; `DeviceCountError` for too few devices) naming the offending text;
`MeshSpec.validate(n, config)` checks
the device count and, table-driven from the rule presets (`DIM_SOURCES`), that every mesh axis product
divides the model dimension that a logical axis maps onto, e.g.
"mesh actor: expert=3 does not divide n_routed_experts=8 (parameter layers.*.ffn.experts.w1, dim 0)".

Sources (ideas, not code): jax docs on `jax.sharding.Mesh` / `AxisType` (Auto axes, so no `out_sharding` is
needed on gathers and contractions, see docs/jax-stack.md §2.2); Tunix `RLCluster(role_to_mesh=...)` and
MaxText's trainer/sampler device split (`setup_configs_and_devices`).
Tests: `.venv/bin/python -m pytest -q tests/sharding/test_mesh.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from sharding import axes as ax
from sharding import rules as rl
from sharding.rules import ACTOR, MESH_AXES, ROLES, ROLLOUT


class MeshSpecError(ValueError):
    """A mesh spec that cannot be parsed or does not fit the devices or the model."""


class DeviceCountError(MeshSpecError):
    """The spec needs more devices than are present (`needed`, `present`)."""

    def __init__(self, message: str, needed: int, present: int):
        super().__init__(message)
        self.needed, self.present = needed, present


def _full_axes(role: str, axes: Mapping[str, int]) -> dict[str, int]:
    unknown = [a for a in axes if a not in MESH_AXES]
    if unknown:
        raise MeshSpecError(f"role {role}: unknown axis {unknown[0]!r}; axes are {', '.join(MESH_AXES)}")
    for name, size in axes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise MeshSpecError(f"role {role}: size of {name} must be an integer >= 1, got {size!r}")
    return {a: int(axes.get(a, 1)) for a in MESH_AXES}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSpec:
    """Axis sizes per role. `actor` / `rollout`: dict mesh-axis -> size over all of `MESH_AXES` (omitted
    axes are filled with 1). `rollout=None` means colocated: the rollout uses the actor mesh itself."""

    actor: Mapping[str, int]
    rollout: Mapping[str, int] | None = None

    def __post_init__(self):
        object.__setattr__(self, "actor", _full_axes(ACTOR, self.actor))
        if self.rollout is not None:
            object.__setattr__(self, "rollout", _full_axes(ROLLOUT, self.rollout))

    def __hash__(self) -> int:  # dict fields: hash the canonical text so MeshSpec/MeshPlan can be static args
        return hash(str(self))

    @property
    def colocated(self) -> bool:
        return self.rollout is None

    def axes(self, role: str) -> dict[str, int]:
        """Axis sizes of `role` (the actor's when colocated)."""
        if role not in ROLES:
            raise MeshSpecError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
        return dict(self.actor if role == ACTOR or self.colocated else self.rollout)

    def shape(self, role: str) -> tuple[int, ...]:
        """Mesh shape of `role` in `MESH_AXES` order."""
        sizes = self.axes(role)
        return tuple(sizes[a] for a in MESH_AXES)

    def size(self, role: str) -> int:
        return math.prod(self.shape(role))

    @property
    def n_devices(self) -> int:
        """Devices the spec occupies (actor + rollout, or just the actor when colocated)."""
        return self.size(ACTOR) + (0 if self.colocated else self.size(ROLLOUT))

    def __str__(self) -> str:
        def role_text(role):
            sizes = self.axes(role)
            items = [f"{a}={s}" for a, s in sizes.items() if s > 1] or [f"{rl.DATA}=1"]
            return f"{role}:" + ",".join(items)

        return role_text(ACTOR) if self.colocated else f"{role_text(ACTOR)}/{role_text(ROLLOUT)}"

    def validate(self, n_devices: int, config: Any = None) -> None:
        """Check the spec against `n_devices` present and, if given, a model config.

        `config` is duck-typed: any object with the attributes named in `DIM_SOURCES` (n_routed_experts,
        num_attention_heads, hidden_size, moe_intermediate_size, o_groups, vocab_size, q_lora_rank,
        index_n_heads, head_dim), e.g. `dsv4.DSV4Config`. Raises MeshSpecError listing every problem.
        """
        a, r = self.size(ACTOR), self.size(ROLLOUT)
        if self.colocated and a > n_devices:
            raise DeviceCountError(f"mesh spec {str(self)!r}: actor (colocated with rollout) needs {a} devices, "
                                   f"but only {n_devices} are present", a, n_devices)
        if not self.colocated and a + r > n_devices:
            raise DeviceCountError(f"mesh spec {str(self)!r}: actor needs {a} devices and rollout {r}, "
                                   f"but only {n_devices} are present", a + r, n_devices)
        if config is not None:
            problems = [p for role in ROLES for p in divisibility_problems(role, self.axes(role), config)]
            if problems:
                raise MeshSpecError("\n".join(problems))


# Logical axis -> (config attribute giving its size, where it appears, dim there). Axes whose size is not a
# config field (batch, sequence, mHC rows, lookup tables) have None and are not checked here. Parameter names
# and dims follow dsv4's [out, in] weight layout; they only label messages. o_in (heads_per_group * head_dim)
# and compress (c * head_dim) are checked through head_dim, which suffices (both are multiples of it).
DIM_SOURCES: dict[str, tuple[str, str, int] | None] = {
    ax.VOCAB: ("vocab_size", "parameter embed.weight", 0),
    ax.EMBED: ("hidden_size", "parameter embed.weight", 1),
    ax.Q_LORA: ("q_lora_rank", "parameter layers.*.attn.wq_a.weight", 0),
    ax.HEADS: ("num_attention_heads", "parameter layers.*.attn.wq_b.weight", 0),
    ax.KV: ("head_dim", "parameter layers.*.attn.wkv.weight", 0),
    ax.O_LORA: ("o_groups", "parameter layers.*.attn.wo_a.weight", 0),
    ax.O_IN: ("head_dim", "parameter layers.*.attn.wo_a.weight", 1),
    ax.COMPRESS: ("head_dim", "parameter layers.*.attn.compressor.wkv.weight", 0),
    ax.INDEX_HEADS: ("index_n_heads", "parameter layers.*.attn.indexer.wq_b.weight", 0),
    ax.EXPERT: ("n_routed_experts", "parameter layers.*.ffn.experts.w1", 0),
    ax.MLP: ("moe_intermediate_size", "parameter layers.*.ffn.experts.w1", 1),
    ax.HC: None,
    ax.TABLE: None,
    ax.LAYERS: None,  # a layer group's repetitions: checked by parallel.pipeline.pipeline_plan
    ax.ACT_BATCH: None,
    ax.ACT_SEQ: None,
    ax.ACT_EMBED: ("hidden_size", "activation [B, T, D]", 2),
    ax.ACT_HEADS: ("num_attention_heads", "activation [B, T, H, d]", 2),
    ax.ACT_VOCAB: ("vocab_size", "activation logits [B, T, V]", 2),
    ax.ACT_EXPERT: ("n_routed_experts", "activation router scores [B, T, E]", 2),
    ax.ACT_STAGE: None,
}


def divisibility_problems(role: str, sizes: Mapping[str, int], config: Any) -> list[str]:
    """Messages for each logical axis of `role`'s rules whose mesh-axis product (under `sizes`) does not
    divide the config dimension it shards (see `DIM_SOURCES`). Empty when everything divides."""
    problems = []
    rules = rl.rules_for(role)
    for logical, _ in rules:
        source = DIM_SOURCES[logical]
        if source is None:
            continue
        field, where, dim = source
        used = [a for a in rl.mesh_axes_for(logical, rules) if sizes[a] > 1]
        parts = math.prod(sizes[a] for a in used)
        if parts == 1:
            continue
        if not hasattr(config, field):
            raise MeshSpecError(f"config {type(config).__name__} has no attribute {field!r} "
                                f"(needed to check logical axis {logical!r})")
        value = getattr(config, field)
        if value % parts:
            split = "*".join(f"{a}={sizes[a]}" for a in used) + ("" if len(used) == 1 else f" (={parts})")
            problems.append(f"mesh {role}: {split} does not divide {field}={value} ({where}, dim {dim})")
    return problems


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def auto_mesh_spec(n_devices: int) -> MeshSpec:
    """The `auto` spec for `n_devices` (rule in the module docstring)."""
    if n_devices < 1:
        raise MeshSpecError(f"auto mesh needs at least one device, got {n_devices}")
    if n_devices == 1:
        return MeshSpec(actor={})
    a = n_devices // 2 if _pow2_floor(n_devices) == n_devices else _pow2_floor(n_devices)
    r = _pow2_floor(n_devices - a)
    ka, kr = a.bit_length() - 1, r.bit_length() - 1
    actor = {rl.FSDP: 1 << (ka // 2), rl.EXPERT: 1 << (ka - ka // 2)}
    tensor = min(1 << (kr // 2), 8)
    rollout = {rl.EXPERT: r // tensor, rl.TENSOR: tensor}
    return MeshSpec(actor=actor, rollout=rollout)


def _parse_role(text: str, section: str) -> tuple[str, dict[str, int]]:
    if ":" not in section:
        raise MeshSpecError(f"mesh spec {text!r}: section {section!r} has no ':'; expected e.g. 'actor:fsdp=2'")
    role, body = (s.strip() for s in section.split(":", 1))
    if role not in ROLES:
        raise MeshSpecError(f"mesh spec {text!r}: unknown role {role!r}; roles are {', '.join(ROLES)}")
    if not body:
        raise MeshSpecError(f"mesh spec {text!r}: role {role} has no axes; expected e.g. '{role}:data=1'")
    sizes: dict[str, int] = {}
    for item in (i.strip() for i in body.split(",")):
        if "=" not in item:
            raise MeshSpecError(f"mesh spec {text!r}: axis entry {item!r} of role {role} is not AXIS=SIZE")
        name, value = (s.strip() for s in item.split("=", 1))
        if name not in MESH_AXES:
            raise MeshSpecError(f"mesh spec {text!r}: unknown axis {name!r} in role {role}; "
                                f"axes are {', '.join(MESH_AXES)}")
        if name in sizes:
            raise MeshSpecError(f"mesh spec {text!r}: axis {name!r} given twice in role {role}")
        try:
            size = int(value)
        except ValueError:
            raise MeshSpecError(f"mesh spec {text!r}: size {value!r} of {role}:{name} is not an integer") from None
        if size < 1:
            raise MeshSpecError(f"mesh spec {text!r}: size {size} of {role}:{name} must be >= 1")
        sizes[name] = size
    return role, sizes


def parse_mesh_spec(spec: str, n_devices: int | None = None) -> MeshSpec:
    """Parse the grammar in the module docstring. `auto` needs the device count: `n_devices`, or else
    `jax.device_count()` (which initialises the backend, so call `maybe_initialize_distributed` first).
    Raises MeshSpecError for an empty spec, unknown role/axis, bad size, duplicate role/axis, or a
    `rollout:` without `actor:`. Device-count and model checks are in `MeshSpec.validate`."""
    text = spec.strip()
    if not text:
        raise MeshSpecError("mesh spec is empty; expected e.g. 'auto' or 'actor:fsdp=2/rollout:tensor=2'")
    if text == "auto":
        return auto_mesh_spec(jax.device_count() if n_devices is None else n_devices)
    roles: dict[str, dict[str, int]] = {}
    for section in (s.strip() for s in text.split("/")):
        if not section:
            raise MeshSpecError(f"mesh spec {text!r}: empty role section")
        role, sizes = _parse_role(text, section)
        if role in roles:
            raise MeshSpecError(f"mesh spec {text!r}: role {role} given twice")
        roles[role] = sizes
    if ACTOR not in roles:
        raise MeshSpecError(f"mesh spec {text!r}: 'rollout:' given without 'actor:' (a lone actor is colocated; "
                            "a rollout always needs an actor)")
    return MeshSpec(actor=roles[ACTOR], rollout=roles.get(ROLLOUT))


def auto_axes(mesh: Mesh | None) -> Mesh | None:
    """`mesh` with every axis of type Auto: the same devices, axis names and order (None passes through).

    Every public function of dsv4-rl that takes a mesh (`dsv4.load_hf_checkpoint`, `dsv4.io.load.init_model`,
    `rl.algo.learner.Learner`, `rl.rollout.engine.Sampler`, `parallel.push.local.WeightPusher`, `MeshPlan`) converts it
    here, so a mesh from `jax.make_mesh` works whatever its axis types (Explicit is its default since jax 0.7).
    Why Auto: the model's programs place arrays by the rule tables (sharding constraints on logical axes) and let XLA propagate
    the rest; under Explicit axes the sharding is part of every array's type, and each op whose output sharding is
    not implied by its inputs (`jnp.repeat` in the FP8 dequantisation, gathers, the expert dispatch, contractions
    over a sharded dim) would need an `out_sharding` argument. The arrays these functions return live on the Auto
    mesh (`NamedSharding(auto_axes(mesh), spec)`); pass the same mesh (either type) to the next function.
    """
    if mesh is None or all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _make_mesh(devices: Sequence[Any], shape: tuple[int, ...]) -> Mesh:
    arr = np.empty(len(devices), dtype=object)
    arr[:] = list(devices)
    return Mesh(arr.reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshPlan:
    """The two role meshes of a run. `actor` / `rollout`: `jax.sharding.Mesh` with axes `MESH_AXES` (Auto);
    `colocated`: the rollout mesh is the actor mesh (same object). `spec`: the MeshSpec it was built from."""

    actor: Mesh
    rollout: Mesh
    colocated: bool
    spec: MeshSpec

    def __post_init__(self):  # meshes from jax.make_mesh (Explicit axes): see `auto_axes`
        object.__setattr__(self, "actor", auto_axes(self.actor))
        object.__setattr__(self, "rollout", auto_axes(self.rollout))

    def mesh(self, role: str) -> Mesh:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
        return self.actor if role == ACTOR else self.rollout

    def rules(self, role: str) -> rl.Rules:
        return rl.rules_for(role)

    def param_shardings(self, role: str, abstract_state: Any) -> Any:
        """`rules.param_shardings` of `abstract_state` on this role's mesh with its rule preset."""
        return rl.param_shardings(abstract_state, self.mesh(role), self.rules(role))

    @contextlib.contextmanager
    def activate(self, role: str) -> Iterator[Mesh]:
        """`jax.set_mesh(mesh)` + `rules.use_rules(rules, mesh)` for `role`; trace that role's jits inside."""
        mesh = self.mesh(role)
        with jax.set_mesh(mesh), rl.use_rules(self.rules(role), mesh):
            yield mesh

    def describe(self) -> str:
        """One line per role: axis sizes and device ids (for the run log; `stage` and `context` only when > 1)."""
        lines = []
        for role in ROLES:
            mesh = self.mesh(role)
            ids = [d.id for d in mesh.devices.flat]
            where = " (colocated with actor)" if role == ROLLOUT and self.colocated else ""
            sizes = " ".join(f"{a}={n}" for a, n in mesh.shape.items() if a not in (rl.STAGE, rl.CONTEXT) or n > 1)
            lines.append(f"{role}: {sizes} devices {ids}{where}")
        return "\n".join(lines)


def build_mesh_plan(spec: str | MeshSpec, devices: Sequence[Any] | None = None, config: Any = None) -> MeshPlan:
    """Parse (if a string), validate against `devices` (default `jax.devices()`) and `config`, and build the
    meshes: actor on `devices[:A]`, rollout on `devices[A:A+R]` (or the actor mesh when colocated).
    Raises MeshSpecError as `parse_mesh_spec` / `MeshSpec.validate`."""
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(spec, str):
        spec = parse_mesh_spec(spec, n_devices=len(devices))
    spec.validate(len(devices), config)
    a = spec.size(ACTOR)
    actor = _make_mesh(devices[:a], spec.shape(ACTOR))
    if spec.colocated:
        return MeshPlan(actor=actor, rollout=actor, colocated=True, spec=spec)
    rollout = _make_mesh(devices[a:a + spec.size(ROLLOUT)], spec.shape(ROLLOUT))
    return MeshPlan(actor=actor, rollout=rollout, colocated=False, spec=spec)


def build_job_plan(spec: str | MeshSpec, role: str, devices: Sequence[Any] | None = None,
                   config: Any = None) -> MeshPlan:
    """The plan of one job of the two-job layout (the actor and the rollout as independent JAX jobs,
    rl/rollout/two_job.py): `role`'s mesh on this job's `devices` (default `jax.devices()`), and the other role's mesh
    a stand-in of the same shape and axis names over this job's devices (the actor needs the rollout's tiling to
    stage its weights, parallel/push/job.py; the rollout job uses no actor mesh). The spec must have a rollout
    section. Raises MeshSpecError for a colocated spec; DeviceCountError when this job has fewer devices than
    `role` needs, or the actor fewer than the rollout (each rollout shard is staged on an actor device)."""
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(spec, str):
        spec = parse_mesh_spec(spec, n_devices=len(devices))
    if spec.colocated:
        raise MeshSpecError(f"mesh spec {str(spec)!r}: a rollout job of its own needs a rollout section "
                            "(e.g. actor:fsdp=2/rollout:expert=2)")
    need = max(spec.size(ACTOR), spec.size(ROLLOUT)) if role == ACTOR else spec.size(ROLLOUT)
    if need > len(devices):
        raise DeviceCountError(f"mesh spec {str(spec)!r}: this {role} job needs {need} devices (the actor at least "
                               f"as many as the rollout), but only {len(devices)} are present", need, len(devices))
    if config is not None:
        problems = [p for r in ROLES for p in divisibility_problems(r, spec.axes(r), config)]
        if problems:
            raise MeshSpecError("\n".join(problems))
    own = _make_mesh(devices[:spec.size(role)], spec.shape(role))
    other = ROLLOUT if role == ACTOR else ACTOR
    standin = _make_mesh(devices[:spec.size(other)], spec.shape(other)) if spec.size(other) <= len(devices) else own
    meshes = {role: own, other: standin}
    return MeshPlan(actor=meshes[ACTOR], rollout=meshes[ROLLOUT], colocated=False, spec=spec)
