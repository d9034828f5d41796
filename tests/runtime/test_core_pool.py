"""The core pool's queue (heaps, counts kept as envs come and go) makes the choices a scan of every ready env makes:
random pushes, estimates, releases and re-plans, both orders, compared step by step with that scan."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from ebrl.runtime.dispatcher import CorePool


class Scan:
    """The choices as a scan: for each free core the ready env with the highest priority, first come among equals
    (by readiness, the counts of envs left per group taken once, before any moves)."""

    def __init__(self, pool: CorePool) -> None:
        self.pool, self.ready = pool, []

    def dispatch(self, free: int) -> list[tuple[int, float]]:
        p, out = self.pool, []
        left = Counter(p.group_of.get(e) for e in [*self.ready, *p.core_of])
        key = (lambda e: (-left[p.group_of[e]], p.estimate(e))) if p.order == "readiness" else p.estimate
        while free and self.ready:
            env = max(self.ready, key=key)
            self.ready.remove(env)
            rivals = [e for e in self.ready if p.order == "longest" or p.group_of[e] == p.group_of[env]]
            out.append((env, max((p.estimate(e) for e in rivals), default=-math.inf)))
            free -= 1
        return out


@pytest.mark.parametrize("order", ["longest", "readiness"])
def test_the_queue_chooses_as_a_scan_of_every_ready_env(order):
    rng = random.Random(0)
    pool = CorePool([0, 1, 2], order=order, spare=[3])
    scan = Scan(pool)
    envs, running = list(range(40)), set()
    for _ in range(3000):
        idle = [e for e in envs if e not in running and e not in pool.ready]
        action = rng.random()
        if action < 0.4 and idle:
            env = rng.choice(idle)
            if rng.random() < 0.7:  # (most have an estimate; the others go first)
                pool.observe(env, rng.choice([0.01, 0.02, 0.03, rng.uniform(0.005, 0.05)]))
            pool.push(env, rng.choice("abc"))
            scan.ready.append(env)
        elif action < 0.75 and running:
            env = rng.choice(sorted(running))
            pool.release(env)
            running.discard(env)
        elif action < 0.78:
            cores = rng.sample(range(5), rng.randint(1, 3))
            pool.resize(cores, spare=[c for c in range(5) if c not in cores][:1])
        elif action < 0.85 and pool.ready:  # a ready env's estimate moves: so does its place
            pool.observe(rng.choice(sorted(pool.ready)), rng.uniform(0.005, 0.05))
        expected = scan.dispatch(len(pool.free))
        before = len(pool.decisions)
        got = pool.dispatch()
        assert [env for env, _ in got] == [env for env, _ in expected]
        assert [d[3] for d in list(pool.decisions)[before:]] == [rival for _, rival in expected]
        running.update(env for env, _ in got)
