"""Tests for tools/audit_composites.py and the audit data it writes."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
TOOL_PATH = REPO / "tools" / "audit_composites.py"
RELEASE = ".".join(torch.__version__.split("+")[0].split(".")[:2])
AUDIT_JSON = REPO / "predispatch" / "data" / f"composite_audit-{RELEASE}.json"  # the installed release's


@pytest.fixture(scope="module")
def audit():
    # tools/ is not a package, so load the script by path.
    spec = importlib.util.spec_from_file_location("audit_composites", TOOL_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def test_type_as_same_dtype_is_a_liar(audit):
    op = torch.ops.aten.type_as.default
    x, other = torch.randn(2, 3), torch.randn(2, 3)
    sample = audit.Sample((x, other), {}, "type_as(f32, f32)")

    observation = audit.check_op(op, [sample])
    assert observation.observed == "alias"
    assert "returned an input itself" in observation.detail

    record = audit.audit_op(op, observation)
    assert record.schema_says == "functional"
    assert not record.tagged
    assert record.is_liar
    assert record.decision == "decompose"


def test_type_as_other_dtype_is_clean(audit):
    # The cast path allocates, so only the same-dtype sample exposes the lie.
    op = torch.ops.aten.type_as.default
    sample = audit.Sample((torch.randn(3), torch.zeros(1, dtype=torch.float64)), {}, "cast")
    assert audit.check_op(op, [sample]).observed == "clean"


def _hand_checked(audit, op):
    # Hand samples only: the OpInfo database import has global side effects
    # (freezes torch.backends flags) that other tests should not inherit.
    return audit.audit_op(op, audit.check_op(op, audit.hand_samples(op)))


def test_linear_is_clean_and_kept(audit):
    record = _hand_checked(audit, torch.ops.aten.linear.default)
    assert record.schema_says == "functional"
    assert record.observed == "clean"
    assert record.decision == "keep"
    assert not record.is_liar


@pytest.mark.parametrize("op", [torch.ops.aten.atleast_1d.default, torch.ops.aten.batch_norm.default])
def test_tagged_op_is_decomposed(audit, op):
    record = _hand_checked(audit, op)
    assert record.tagged
    assert record.observed in ("alias", "mutates")  # the tag is deserved
    assert record.decision == "decompose"
    assert not record.is_liar  # tagged ops are not counted as liars


def test_mutating_input_is_detected(audit):
    # instance_norm updates running stats in place despite a functional schema.
    op = torch.ops.aten.instance_norm.default
    running_mean, running_var = torch.zeros(3), torch.ones(3)
    args = (torch.randn(2, 3, 4), None, None, running_mean, running_var, True, 0.1, 1e-5, False)
    assert audit.check_op(op, [audit.Sample(args, {}, "instance_norm")]).observed == "mutates"


def test_schema_reading(audit):
    assert audit.schema_says(torch.ops.aten.add.Tensor) == "functional"
    assert audit.schema_says(torch.ops.aten.reshape.default) == "alias"
    assert audit.schema_says(torch.ops.aten.add_.Tensor) == "mutates"
    assert audit.is_tagged(torch.ops.aten.dropout.default)


def test_committed_audit_json():
    data = json.loads(AUDIT_JSON.read_text())
    assert "aten::type_as" in data["liars"]
    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert ".".join(data["torch_version"].split(".")[:2]) == major_minor
    # liars are functional-schema ops that are not already tagged
    assert not set(data["liars"]) & set(data["tagged"])
    assert data["checked"] <= data["functional_schema"]
    assert "aten::linear" not in data["liars"]


def test_committed_audit_is_the_installed_torchs(audit):
    """The audit, run now on the installed torch, writes exactly what is
    committed for its release (the data the default policy reads, and its page)."""
    records = audit.run_audit()
    assert audit.render_json(records) == AUDIT_JSON.read_text()
    assert audit.render_markdown(records) == (REPO / "design" / f"composite_audit-{RELEASE}.md").read_text()
