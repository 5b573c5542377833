"""Every ``calid bench`` command, in the order ``calid bench --help`` lists them.

Engine benchmarks (calid/bench/) measure the library in one process; served benchmarks (serve_app/bench/) measure
a running calid app through its gRPC or HTTP front. Each module's ``add_parser(sub)`` adds its subcommand (or
subcommands) and sets the function that runs it.
"""
from __future__ import annotations

from calid.bench import (ar, decode, dtype, gpu, invariance, parallel, quality_curve, sarathi, step, structured,
                         trees)
from serve_app.bench import (edge_drafting, hostile, http, load, modes, pareto, peers, placement_live, serve,
                             soak, structured_served)

ENGINE = (ar, decode, quality_curve, trees, sarathi, parallel, dtype, step, invariance, gpu, structured)
SERVED = (serve, hostile, edge_drafting, load, http, modes, peers, pareto, placement_live, soak, structured_served)


def add_parsers(sub) -> None:
    for module in ENGINE + SERVED:
        module.add_parser(sub)
