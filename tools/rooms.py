"""The rooms of the project and the imports allowed between them: the table that
`python -m tools.import_graph` checks (CI runs it through tests/test_import_rules.py). A room is a
folder of `engine/` or `server/` (`engine.kv`, `server.flow`), the loose modules at the top of
`engine/` or `server/` (`engine`: the door, the config, the offline `LLM`; `server`: the app and
its state), `models` or `kernels`. An import inside a room is always allowed; one between rooms
must be in `ALLOWED`, or reach a leaf: a module of plain values that imports only other leaves,
which every engine and server room may read.

To add an edge, add it here with the reason beside it: the table is where the architecture is
argued, so a new dependency is a reviewed line, not a drift found later.
"""

from __future__ import annotations

# value types every engine and server room may import; each imports only leaves (checked)
LEAVES = frozenset(
    {
        "engine.core.request",  # a request's state
        "engine.core.images",  # a prompt's images (placement, content hash, pixels)
        "engine.core.positions",  # a request's own rotary positions (M-RoPE)
        "engine.core.sampling_params",  # what a request asks for
        "engine.core.sampled",  # what sampling yields (token logprobs, picks)
        "engine.core.batch",  # a step's grant and result, the grammar mask that goes with it
        "engine.core.outputs",  # what a step hands back per request
        "engine.core.snapshot",  # plain data the server reads
        "engine.core.engine_info",  # the engine's facts, and the prompt checks on them
        "engine.core.step_budget",  # step costs and the budget's arithmetic (pure: no clock)
        "engine.spec.draft_state",  # a request's drafting state
        "engine.spec.suffix_index",  # the suffix index that state holds
    }
)

ENGINE_ROOMS = (
    "engine",
    "engine.attention",
    "engine.build",
    "engine.core",
    "engine.grammar",
    "engine.kv",
    "engine.lora",
    "engine.parallel",
    "engine.runner",
    "engine.spec",
    "engine.weights",
)

ALLOWED: dict[str, frozenset[str]] = {
    "kernels": frozenset(),  # the bottom: C++ sources, their loader and build helper
    "models": frozenset({"kernels"}),
    "engine.attention": frozenset({"models", "kernels"}),
    "engine.kv": frozenset(),
    "engine.lora": frozenset({"models"}),
    "engine.grammar": frozenset({"models", "kernels"}),
    # the step: backends, tables, the model; the grammar's bitmask op, the verifier every
    # draft source shares, and the tensor-parallel group the forward joins
    "engine.runner": frozenset(
        {
            "engine.attention",
            "engine.kv",
            "models",
            "kernels",
            "engine.grammar",
            "engine.spec",
            "engine.parallel",
        }
    ),
    # drafts read the runner's step inputs and sampling, the backends (the head's own layer)
    # and the grammar (forced tokens)
    "engine.spec": frozenset(
        {"engine.runner", "engine.attention", "engine.grammar", "engine.kv", "models", "kernels"}
    ),
    "engine.weights": frozenset({"engine.runner", "engine.attention", "models", "kernels"}),
    # a worker rank builds its own engine half (one builder for every rank) from the config
    "engine.parallel": frozenset(
        {
            "engine",
            "engine.build",
            "engine.runner",
            "engine.attention",
            "engine.kv",
            "models",
            "kernels",
        }
    ),
    # the builder imports every engine room once, to build them whole
    "engine.build": frozenset(ENGINE_ROOMS) | {"models", "kernels"},
    # LLMEngine: built by the builder, it steps scheduler, runner, drafter and outputs
    "engine.core": frozenset(
        {
            "engine",
            "engine.build",
            "engine.kv",
            "engine.lora",
            "engine.runner",
            "engine.spec",
            "engine.grammar",
            "models",
        }
    ),
    # the door (AsyncEngine), the config and the offline LLM over the core
    "engine": frozenset(ENGINE_ROOMS) | {"models"},
    "server.protocol": frozenset({"server"}),
    "server.flow": frozenset({"server", "server.protocol", "engine", "engine.grammar", "models"}),
    "server.routes": frozenset(
        {"server", "server.flow", "server.protocol", "engine", "engine.lora", "models"}
    ),
    # the app over the door; `kvserve kernels` prints the kernel matrix (build, attention)
    "server": frozenset(
        {
            "server.flow",
            "server.protocol",
            "server.routes",
            "engine",
            "engine.build",
            "engine.attention",
            "engine.grammar",
            "models",
        }
    ),
}


def room(module: str, is_package: bool) -> str:
    """`engine.kv.pool` -> `engine.kv`; `engine.config` -> `engine`; `models.x` -> `models`."""
    parts = module.split(".")
    if parts[0] in ("engine", "server"):
        if len(parts) > 2 or (len(parts) == 2 and is_package):
            return ".".join(parts[:2])
        return parts[0]
    return parts[0]


def violations(edges: dict[str, set[str]], packages: set[str]) -> list[tuple[str, str]]:
    """Edges between rooms the table does not allow, and leaves importing what is not a leaf.
    `packages`: the modules that are packages (their `__init__`)."""
    bad = []
    for a, targets in edges.items():
        ra = room(a, a in packages)
        for b in targets:
            rb = room(b, b in packages)
            if a in LEAVES:
                if b not in LEAVES and rb != "models":
                    bad.append((a, b))
            elif ra != rb and b not in LEAVES and rb not in ALLOWED.get(ra, frozenset()):
                bad.append((a, b))
    return sorted(bad)
