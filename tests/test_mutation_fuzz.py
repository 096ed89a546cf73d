"""Structural mutants of .kvz files (checksums recomputed) are refused or load unchanged.

The property of :mod:`kvz_mutate`: ``load`` raises FormatError, or returns exactly what the
writer wrote. CI tries 3,000 mutants over every codec, zstd and mixed policies;
``KVTOOL_MUTANTS=12000`` scales it up (``python tests/kvz_mutate.py`` prints the table).
"""

from __future__ import annotations

import os

from kvz_mutate import MUTATIONS, run, table


def test_no_mutant_loads_silently_or_crashes(tmp_path):
    cases = int(os.environ.get("KVTOOL_MUTANTS", 3000))
    results = run(cases, seed=int(os.environ.get("KVTOOL_MUTANTS_SEED", 0)),
                  directory=str(tmp_path))
    report = table(results)
    bad = {kind: {o: n for o, n in c.items() if o not in ("refused", "identical")}
           for kind, c in results.items()}
    assert not any(bad.values()), f"{bad}\n{report}"
    # every mutation class ran and was refused at least once: the fuzzer exercises the checks
    assert len(results) == len(MUTATIONS) + 1  # m_tokens reports "bomb" or "token ids"
    assert all(c["refused"] > 0 for c in results.values()), report
    assert sum(sum(c.values()) for c in results.values()) == cases
