"""The rooms' import rules, executable (tools/rooms.py, checked by `python -m tools.import_graph`):
no circle, no upward import, every room documented, and every import between rooms allowed by
the table or reaching a leaf; an edge added against the table, or a leaf that stops being one,
is caught."""

from __future__ import annotations

from tools.import_graph import circles, graph, project_modules, undocumented_rooms, upward
from tools.rooms import ALLOWED, LEAVES, room, violations


def _graph() -> tuple[dict[str, set[str]], set[str]]:
    modules = project_modules()
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    return graph(modules), packages


def test_the_project_keeps_its_room_rules() -> None:
    edges, packages = _graph()
    assert circles(edges) == []
    assert upward(edges) == []
    assert undocumented_rooms(project_modules()) == []
    assert violations(edges, packages) == []


def test_every_room_and_leaf_in_the_table_exists() -> None:
    edges, packages = _graph()
    rooms = {room(m, m in packages) for m in edges}
    assert rooms <= set(ALLOWED), rooms - set(ALLOWED)  # a new room needs its row
    assert LEAVES <= set(edges)


def test_an_edge_against_the_table_is_caught() -> None:
    edges, packages = _graph()
    # the KV tier reaching up into the runner, and a leaf importing the scheduler
    edges["engine.kv.pool"].add("engine.runner.model_runner")
    edges["engine.core.batch"].add("engine.core.scheduler")
    # inside a room and into a leaf stay allowed
    edges["engine.kv.disk"].add("engine.kv.pool")
    edges["engine.kv.disk"].add("engine.core.request")
    assert violations(edges, packages) == [
        ("engine.core.batch", "engine.core.scheduler"),
        ("engine.kv.pool", "engine.runner.model_runner"),
    ]
