"""torch's ExportDB (``torch._export.db.examples``): the example modules
torch.export documents, each exported by predispatch and compared with eager.

An example torch marks supported must export and match eager (outputs and
which require grad, gradients of the parameters, buffers and inputs
afterwards, under grad mode on and off, re-export stable), with the
example's dynamic shapes; one torch does not support yet must be refused
with an ``ExportError``, or torch.export's own ``UserError`` (a dynamic-shapes
problem), never another error."""
from __future__ import annotations

import pytest
import torch
from torch._export.db.case import SupportLevel
from torch._export.db.examples import all_examples

import predispatch
from predispatch.testing.eager import assert_matches_eager

EXAMPLES = sorted(all_examples().items())


@pytest.mark.parametrize("name, case", [pytest.param(n, c, id=n) for n, c in EXAMPLES
                                         if c.support_level is SupportLevel.SUPPORTED])
def test_supported_example_matches_eager(name, case):
    kwargs = dict(case.example_kwargs) if case.example_kwargs else None
    # inputs that do not require grad: some examples write their inputs in place, which eager refuses for leaves
    assert_matches_eager(case.model, case.example_args, kwargs, dynamic_shapes=case.dynamic_shapes,
                         inputs_require_grad=False)


@pytest.mark.parametrize("name, case", [pytest.param(n, c, id=n) for n, c in EXAMPLES
                                         if c.support_level is not SupportLevel.SUPPORTED])
def test_unsupported_example_is_refused(name, case):
    with pytest.raises((predispatch.ExportError, torch._dynamo.exc.UserError)):
        predispatch.export_predispatch(case.model, case.example_args, case.example_kwargs,
                                       dynamic_shapes=case.dynamic_shapes)
