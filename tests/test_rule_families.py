"""Rules are found in family subpackages of `rules/`, and the sharded-training family carries the
codes, names, severities and defaults of the spec."""

from __future__ import annotations

from distdoctor.lint.rule import all_rules

SHARDED = {
    "DD501": ("optimizer-before-shard", "error", True),
    "DD502": ("no-sync-under-fsdp2", "warning", True),
    "DD503": ("fsdp2-module-attribute", "error", True),
    "DD504": ("fsdp-clip-local-norm", "error", True),
    "DD505": ("sharded-collective-under-rank-guard", "error", True),
    "DD506": ("sharded-state-saved-on-rank0", "error", True),
    "DD507": ("fp16-without-sharded-scaler", "warning", True),
    "DD508": ("cast-before-shard", "warning", True),
    "DD509": ("fsdp-root-only", "info", False),
    "DD510": ("meta-init-order", "error", True),
}


def test_sharded_family_matches_the_spec():
    found = {r.code: (r.name, r.severity, r.default_on) for r in all_rules() if r.code.startswith("DD5")}
    assert found == SHARDED

