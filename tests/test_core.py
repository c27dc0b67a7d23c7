"""G1-G5 and G7 on the hard corners, each compared with eager."""
import copy

import pytest
import torch

import cases
import predispatch
from predispatch.testing.eager import assert_matches_eager
from predispatch.testing.invariants import all_graph_modules

HOPS = {torch.ops.higher_order.wrap_with_set_grad_enabled: "grad",
        torch.ops.higher_order.wrap_with_autocast: "autocast"}


def region_tree(gm, depth=0):
    """[(depth, region submodule name, hop args)] in graph order, nested ones below."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in HOPS:
            sub = next(a for a in node.args if isinstance(a, torch.fx.Node))
            out.append((depth, sub.target, tuple(a for a in node.args[: node.args.index(sub)])))
            out += region_tree(getattr(gm, sub.target), depth + 1)
    return out


def specs(ep):
    return [(s.kind.name, s.target) for s in ep.graph_signature.output_specs]


def ops(ep):
    return {n.target for m in all_graph_modules(ep.graph_module) for n in m.graph.nodes
            if n.op == "call_function"}


def test_seed_example():
    ep = assert_matches_eager(cases.Seed(), (torch.ones(2),))
    assert region_tree(ep.graph_module) == [(0, "no_grad_0", (False,))]


def test_input_mutated_under_no_grad_keeps_history():
    ep = assert_matches_eager(cases.InputMutatedUnderNoGrad(), (torch.randn(3), torch.randn(3)))
    assert ("USER_INPUT_MUTATION", "x") in specs(ep)


def test_input_mutated_through_view():
    ep = assert_matches_eager(cases.InputMutatedThroughView(), (torch.randn(2, 3), torch.randn(2, 3)))
    assert ("USER_INPUT_MUTATION", "x") in specs(ep)


def test_input_mutated_with_grad():
    ep = assert_matches_eager(cases.InputMutatedWithGrad(), (torch.randn(3), torch.randn(3)),
                              inputs_require_grad=False)
    assert ("USER_INPUT_MUTATION", "x") in specs(ep)


def test_input_mutated_through_a_detached_alias_keeps_history():
    ep = assert_matches_eager(cases.MutatedThroughDetachedAlias(), (torch.randn(3, 4),))
    assert ("USER_INPUT_MUTATION", "x") in specs(ep)


def test_view_made_before_a_no_grad_block_and_mutated_inside():
    assert_matches_eager(cases.ViewMadeBeforeNoGrad(), (torch.randn(3, 4),))


def test_detached_alias_updated_with_a_grad_operand_gets_the_update_s_history():
    """Eager gives the alias the update's history (its base keeps its own):
    reads of the alias, replayed from memory, keep a snapshot's history."""
    assert_matches_eager(cases.DetachedAliasUpdatedWithGrad(), (torch.randn(3),))


def test_kept_history_feeds_later_kept_history():
    assert_matches_eager(cases.MutatedUnderNoGradAfterEnableGrad(), (torch.randn(3, 4),))


def test_ema_and_weight_decay_of_parameters_under_no_grad():
    ep = assert_matches_eager(cases.EMA(), (torch.randn(2, 4),))
    assert ("BUFFER_MUTATION", "shadow") in specs(ep)
    assert ("PARAMETER_MUTATION", "lin.weight") in specs(ep)


def test_buffer_counters():
    ep = assert_matches_eager(cases.Counter(), (torch.randn(2, 3),))
    assert {("BUFFER_MUTATION", "steps"), ("BUFFER_MUTATION", "total")} <= set(specs(ep))


@pytest.mark.parametrize("train", [True, False])
def test_batch_norm(train):
    ep = assert_matches_eager(cases.BatchNormNet().train(train), (torch.randn(5, 3),))
    mutated = {t for k, t in specs(ep) if k == "BUFFER_MUTATION"}
    assert mutated == ({"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"} if train else set())


def test_nested_grad_modes_keep_their_nesting():
    ep = assert_matches_eager(cases.NestedGrad(), (torch.randn(3),))
    assert region_tree(ep.graph_module) == [
        (0, "no_grad_0", (False,)), (1, "enable_grad_1", (True,)), (2, "no_grad_2", (False,))]


def test_decorator_form():
    ep = assert_matches_eager(cases.DecoratedNoGrad(), (torch.randn(3),))
    assert region_tree(ep.graph_module) == [(0, "no_grad_0", (False,))]


def test_set_grad_enabled_decorator_form():
    ep = assert_matches_eager(cases.DecoratedSetGradEnabled(), (torch.randn(3),))
    assert region_tree(ep.graph_module) == [(0, "no_grad_0", (False,))]


def test_autocast_disabled_inside_autocast():
    ep = assert_matches_eager(cases.AutocastBlocks(), (torch.randn(2, 4),), atol=1e-2, rtol=1e-2)
    assert region_tree(ep.graph_module) == [
        (0, "autocast_bfloat16_0", ("cpu", torch.bfloat16, True, True)),
        (1, "autocast_off_1", ("cpu", None, False, False)),
    ] or [r[:2] for r in region_tree(ep.graph_module)] == [(0, "autocast_bfloat16_0"), (1, "autocast_off_1")]


def test_autocast_inside_no_grad():
    ep = assert_matches_eager(cases.AutocastInsideNoGrad(), (torch.randn(2, 4),), atol=1e-2, rtol=1e-2)
    assert [r[:2] for r in region_tree(ep.graph_module)] == [(0, "no_grad_0"), (1, "autocast_bfloat16_1")]


def test_no_grad_inside_autocast_is_not_flattened():
    ep = assert_matches_eager(cases.NoGradInsideAutocast(), (torch.randn(2, 4),), atol=1e-2, rtol=1e-2)
    assert [r[:2] for r in region_tree(ep.graph_module)] == [(0, "autocast_bfloat16_0"), (1, "no_grad_1")]


def test_top_level_enable_grad_is_a_region_under_ambient_no_grad():
    ep = assert_matches_eager(cases.TopLevelEnableGrad(), (torch.randn(3),))
    assert region_tree(ep.graph_module) == [(0, "enable_grad_0", (True,))]
    with torch.no_grad():
        out = ep.module()(torch.randn(3))
    assert out.requires_grad


def test_outputs_aliasing_inputs():
    assert_matches_eager(cases.AliasingOutputs(), (torch.randn(2, 3),))


class _Twice(torch.nn.Module):
    def forward(self, a, b):
        return a * b + a


def test_same_tensor_passed_twice():
    x = torch.randn(3)
    ep = predispatch.export_predispatch(_Twice(), (x, x))
    a = torch.randn(3, requires_grad=True)
    torch.testing.assert_close(ep.module()(a, a), _Twice()(a, a))
    assert_matches_eager(_Twice(), (x, x.clone()))


def test_pytree_and_keyword_inputs_and_outputs():
    args = ({"x": torch.randn(2, 3), "pair": (torch.randn(3), torch.randn(2, 3))}, 3)
    kwargs = {"extra": torch.randn(2), "bias": torch.randn(3)}
    ep = assert_matches_eager(cases.PytreeIO(), args, kwargs)
    out = ep.module()(*args, **kwargs)
    assert set(out) == {"out", "parts", "extra"} and out["parts"][1] is None and out["parts"][2] == 3


def test_dynamic_batch_dimension():
    batch = torch.export.Dim("batch")
    ep = assert_matches_eager(cases.DynamicBatch(), (torch.randn(4, 4),),
                              dynamic_shapes={"x": {0: batch}})
    assert len(ep.range_constraints) == 1
    torch.testing.assert_close(ep.module()(torch.ones(7, 4)).shape, torch.Size([7, 2]))


class _StorageSizeThroughAView(torch.nn.Module):
    def forward(self, x):
        y = x[:, 1:]
        return y * (y.untyped_storage().nbytes() // y.element_size())  # the whole storage's


def test_dynamic_shapes_storage_size_read_through_a_view():
    """The traced tensors' storage sizes stay symbolic and right (a wrapper of a
    symbolic tensor takes the wrapped tensor's storage size)."""
    ep = assert_matches_eager(_StorageSizeThroughAView(), (torch.randn(3, 5),),
                              dynamic_shapes=({1: torch.export.Dim("d", min=3, max=64)},))
    x = torch.randn(3, 7)
    torch.testing.assert_close(ep.module()(x), _StorageSizeThroughAView()(x))


def test_type_as_and_reshape_are_decomposed():
    ep = assert_matches_eager(cases.TypeAs(), (torch.randn(2, 3), torch.randn(2, 3)))
    names = {getattr(t, "__name__", str(t)) for t in ops(ep)}
    assert torch.ops.aten.type_as.default not in ops(ep)
    assert torch.ops.aten.reshape.default not in ops(ep), names


def test_exception_in_region_does_not_leak_grad_mode():
    class Boom(torch.nn.Module):
        def forward(self, x):
            with torch.no_grad():
                y = x.reshape(2, 3)
            return y

    ep = predispatch.export_predispatch(Boom(), (torch.randn(6),))
    with pytest.raises(Exception):
        ep.graph_module.no_grad_0(torch.randn(5))  # reshape fails inside the region
    with pytest.raises(Exception):
        torch.ops.higher_order.wrap_with_set_grad_enabled(False, ep.graph_module.no_grad_0, torch.randn(5))
    assert torch.is_grad_enabled()


def test_exception_in_autocast_region_does_not_leak_autocast():
    ep = predispatch.export_predispatch(cases.AutocastBlocks(), (torch.randn(2, 4),))
    with pytest.raises(Exception):
        ep.module()(torch.randn(2, 5))  # the linear fails inside the region
    assert not torch.is_autocast_enabled("cpu")
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16  # the default, restored


def test_hooks_on_a_region_submodule_still_run():
    """Regions skip nn.Module.__call__ for speed, but not when it has hooks to run."""
    program = predispatch.export_predispatch(cases.Seed(), (torch.randn(3),)).module()
    seen = []
    program.no_grad_0.register_forward_hook(lambda mod, args, out: seen.append(torch.is_grad_enabled()))
    program(torch.randn(3))
    assert seen == [False]


class _CastBack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.lin(x).float()
        return (x @ self.lin.weight).float() + y


def test_run_time_module_calls_ops_cheaply_and_keeps_its_graph():
    """ep.module()'s code calls aten ops through their C++ entry points and
    the ``.to()`` guard ``_assert_tensor_metadata`` through a check that names
    the cast and calls its Python binding (a sixth of the boxed call's cost);
    its graph keeps the aten ops (for passes and pattern matchers), the
    program's code is left as it was, and the guard still fires, saying why."""
    assert_matches_eager(_CastBack(), (torch.randn(2, 4),))
    ep = predispatch.export_predispatch(_CastBack(), (torch.randn(2, 4),))
    program = ep.module()
    guard = torch.ops.aten._assert_tensor_metadata.default
    assert guard in ops(ep)  # in the region and out of it
    program_ops = {n.target for m in all_graph_modules(program) for n in m.graph.nodes
                   if n.op == "call_function"}
    assert program_ops >= {guard, torch.ops.aten.linear.default, torch.ops.aten.matmul.default}
    program_code = "".join(m.code for m in all_graph_modules(program))
    assert "dtype_guard(" in program_code
    assert "aten_linear_default(" in program_code and "torch.ops.aten.linear" not in program_code
    ep_code = "".join(m.code for m in all_graph_modules(ep.graph_module))
    assert "torch.ops.aten.linear.default(" in ep_code and "aten_linear_default" not in ep_code
    with torch.autocast("cpu", dtype=torch.bfloat16):  # x @ w is bf16 now, not the traced float32
        with pytest.raises(RuntimeError, match=r"cast at .*test_core.py:\d+ .* was traced for a float32 tensor; "
                           r"this call gives it bfloat16: this call runs under torch.autocast\('cpu', "
                           r"dtype=torch.bfloat16\), the program was exported under no autocast"):
            program(torch.randn(2, 4))


class _MutatesAfterConstants(torch.nn.Module):
    def forward(self, flag, x, n=3, y=None, note="a"):
        with torch.no_grad():  # written back under no_grad, as eager did
            y.mul_(n)
            x.add_(1.0)
        return x * y if flag else x


def test_input_mutations_among_constant_inputs():
    """Constant inputs (bool, int, None, str) are flat inputs too: the
    mutated tensors after them keep their own write-back mode (found by the
    model sweep: Whisper's SpecAugment with use_cache=False)."""
    args = (True, torch.randn(3))
    kwargs = {"n": 2, "y": torch.randn(3), "note": "b"}
    assert_matches_eager(_MutatesAfterConstants(), args, kwargs)
    ep = predispatch.export_predispatch(_MutatesAfterConstants(), args, kwargs)
    assert [k for k, _ in specs(ep)] == ["USER_INPUT_MUTATION", "USER_INPUT_MUTATION", "USER_OUTPUT"]


class _InferenceModeBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    @torch.inference_mode()
    def statistic(self, x):
        return self.lin(x).mean()

    def forward(self, x):
        with torch.inference_mode():
            y = self.lin(x) * 2
        with torch.inference_mode(False):  # switches grad mode on, even under no_grad
            z = self.lin(x)
        return z, z + y + self.statistic(x)


def test_inference_mode_blocks_are_grad_mode_regions():
    """inference_mode switches grad mode off in C++, out of the tracer's
    sight: without the region the program would differentiate the block.
    inference_mode(False) switches it on: under a no_grad caller z keeps
    its history, as in eager."""
    ep = assert_matches_eager(_InferenceModeBlocks(), (torch.randn(2, 4),))
    assert [(d, args) for d, _, args in region_tree(ep.graph_module)] == [
        (0, (False,)), (0, (True,)), (0, (False,))]


class _GradOnInsideInferenceMode(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):
        with torch.inference_mode(), torch.enable_grad():  # autograd still records nothing
            return x * self.w


def test_grad_on_inside_inference_mode_is_refused():
    with pytest.raises(predispatch.ExportError, match=r"inside a torch.inference_mode\(\) block at .*test_core.py:\d+ in forward"):
        predispatch.export_predispatch(_GradOnInsideInferenceMode(), (torch.randn(3),))


class _DataEMA(torch.nn.Module):
    """Older EMA and weight-clipping code works through ``.data``."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4, 4))

    def forward(self, x):
        self.ema.data.mul_(0.9).add_(0.1 * self.lin.weight.data)
        self.lin.weight.data.clamp_(-0.3, 0.3)
        w = self.lin.weight.data  # read without history
        return self.lin(x) + self.ema.sum() + (w * 2).sum()


def test_data_is_a_detached_alias():
    """``t.data`` leaves no node in the trace: read as ``t.detach()``, so
    neither reads nor in-place updates through it carry gradients."""
    ep = assert_matches_eager(_DataEMA(), (torch.randn(2, 4),))
    assert {("BUFFER_MUTATION", "ema"), ("PARAMETER_MUTATION", "lin.weight")} <= set(specs(ep))


class _GradModeToggles(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        previous = torch.is_grad_enabled()
        torch.set_grad_enabled(False)  # a function call, not a block
        frozen = self.lin(x)
        torch.set_grad_enabled(False)  # no change: no block
        torch.set_grad_enabled(previous)
        with torch.no_grad():
            torch.set_grad_enabled(True)  # toggles nest in blocks
            inner = self.lin(frozen)
            torch.set_grad_enabled(False)
        return self.lin(x) + frozen + inner


class _EnablesGradAndRestores(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        prev = torch.is_grad_enabled()
        torch.set_grad_enabled(True)  # a no-op while tracing, not for a caller under no_grad
        y = self.lin(x) * 2
        torch.set_grad_enabled(prev)
        return y


class _ReadsTheModeOnTwoLines(torch.nn.Module):
    def forward(self, x):
        prev = (
            torch.is_grad_enabled()
        )
        torch.set_grad_enabled(False)
        y = x * 2
        torch.set_grad_enabled(prev)
        return y + x


def test_the_mode_read_before_is_found_in_the_bytecode_whatever_the_layout():
    ep = assert_matches_eager(_ReadsTheModeOnTwoLines(), (torch.randn(3),))
    assert [(d, args) for d, _, args in region_tree(ep.graph_module)] == [(0, (False,))]


def test_a_toggle_on_restored_to_the_mode_read_before_is_an_enable_grad_region():
    """Under no_grad, eager computes ``y`` with grad on: the program too (an
    enable_grad region; before, the pair was refused, or dropped as no-ops)."""
    ep = assert_matches_eager(_EnablesGradAndRestores(), (torch.randn(2, 4),))
    assert [(d, args) for d, _, args in region_tree(ep.graph_module)] == [(0, (True,))]
    with torch.no_grad():
        assert ep.module()(torch.randn(2, 4)).requires_grad


def test_set_grad_enabled_called_as_a_function_and_restored():
    """A toggle and the toggle back to the previous mode make a region."""
    ep = assert_matches_eager(_GradModeToggles(), (torch.randn(2, 4),))
    assert [(d, args) for d, _, args in region_tree(ep.graph_module)] == [
        (0, (False,)), (0, (False,)), (1, (True,))]


class _ReassignedBuffers(torch.nn.Module):
    """Custom running statistics are often rebound, not updated in place."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("running_mean", torch.zeros(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            self.running_mean = 0.9 * self.running_mean + 0.1 * y.mean(0)
        self.steps = self.steps + 1
        return y - self.running_mean


def test_reassigned_buffers_are_buffer_mutations():
    ep = assert_matches_eager(_ReassignedBuffers(), (torch.randn(2, 4),))
    assert {("BUFFER_MUTATION", "running_mean"), ("BUFFER_MUTATION", "steps")} <= set(specs(ep))


class _RenormedEmbeddings(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4, max_norm=1.0)
        self.bag = torch.nn.EmbeddingBag(10, 4, max_norm=0.5, mode="mean")

    def forward(self, ids):
        return self.emb(ids).sum(1) + self.bag(ids)


def test_embedding_max_norm_renorms_without_losing_the_weight_gradient():
    """F.embedding renorms the weight in place through a detached alias,
    inside the call: replayed where the recorder sees it."""
    ids = torch.tensor([[1, 2, 4], [4, 3, 9]])
    ep = assert_matches_eager(_RenormedEmbeddings(), (ids,))
    assert {("PARAMETER_MUTATION", "emb.weight"), ("PARAMETER_MUTATION", "bag.weight")} <= set(specs(ep))


class _SharedWeightUnderAutocast(torch.nn.Module):
    """A weight used twice in one autocast block (ALBERT's shared layers, an
    unrolled RNN cell): eager casts it once, through autocast's cast cache."""

    def __init__(self):
        super().__init__()
        self.cell = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.tanh(self.cell(x))
            h = torch.tanh(self.cell(h))
        return h.float()


def test_autocast_regions_keep_the_cast_cache_flag_eager_uses():
    """While tracing torch turns the cache off; the region records the flag
    the block has in eager (the default: on), so gradients round the same."""
    ep = assert_matches_eager(_SharedWeightUnderAutocast(), (torch.randn(3, 4),))
    assert [args for _, _, args in region_tree(ep.graph_module)] == [("cpu", torch.bfloat16, True, True)]


class _TiedAndMutated(torch.nn.Module):
    """One parameter under two names, decayed through one, read through the other."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        with torch.no_grad():
            self.b.weight.mul_(0.5)
        return self.a(x) + self.b(x)


def test_tied_parameters_mutated_through_one_name():
    ep = assert_matches_eager(_TiedAndMutated(), (torch.randn(2, 4),))
    assert [k for k, _ in specs(ep)].count("PARAMETER_MUTATION") == 1


class _AutocastWithoutDtype(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu"):  # the dtype current when the block is entered
            return self.lin(x)


def test_autocast_without_a_dtype_takes_it_at_run_time(tmp_path):
    """The region records no dtype: under an enclosing autocast(float16), or
    after torch.set_autocast_dtype, the program computes in float16 like
    eager (before: bfloat16, the dtype seen while exporting); also after
    save and load."""
    module, x = _AutocastWithoutDtype(), torch.randn(3, 4)
    ep = predispatch.export_predispatch(copy.deepcopy(module), (x,))
    assert [r.args[:2] for r in predispatch.regions(ep)] == [("cpu", None)]
    torch.export.save(ep, tmp_path / "p.pt2")
    programs = [ep.module(), predispatch.load(tmp_path / "p.pt2").module()]
    with torch.autocast("cpu", dtype=torch.float16):
        expected = module(x)
        for program in programs:
            torch.testing.assert_close(program(x), expected)
    previous = torch.get_autocast_dtype("cpu")
    torch.set_autocast_dtype("cpu", torch.float16)
    try:
        assert {program(x).dtype for program in programs} == {module(x).dtype} == {torch.float16}
    finally:
        torch.set_autocast_dtype("cpu", previous)
    assert programs[0](x).dtype == module(x).dtype == torch.bfloat16


class _PositionTable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(8, 4))

    def forward(self, x):
        return x + self.table[: x.shape[0]]


class _BuffersFirst(torch.nn.Module):
    """A submodule holding only buffers before one with parameters."""

    def __init__(self):
        super().__init__()
        self.pos = _PositionTable()
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x):
        with torch.no_grad():
            y = self.pos(x)
        return self.bn(y)


def test_reexport_lifts_buffers_in_the_same_order():
    """torch's unlift made ``bn`` before ``pos`` (parameters are assigned
    first), so a re-export lifted ``pos.table`` last: G7 (assert_matches_eager
    re-exports and compares)."""
    ep = assert_matches_eager(_BuffersFirst(), (torch.randn(3, 4),))
    again = predispatch.export_predispatch(ep.module(), (torch.randn(3, 4),))
    assert ([s.target for s in again.graph_signature.input_specs]
            == [s.target for s in ep.graph_signature.input_specs])


class _CachesABias(torch.nn.Module):
    """Like transformers' LeViT in eval mode: a tensor cached on the module."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.ones(4))
        self.cache = {}

    def forward(self, x):
        if "bias" not in self.cache:
            self.cache["bias"] = self.bias * 2
        return x + self.cache["bias"]


def test_tensors_assigned_to_module_attributes_are_put_back():
    """The trace's tensors never stay in the user's module (they broke its next
    eager call and deepcopy); as torch.export does, assignments are undone
    with a warning that they must be buffers."""
    module, x = _CachesABias(), torch.randn(2, 4)
    with pytest.warns(UserWarning, match=r"self.cache\['bias'\] was assigned during export"):
        ep = predispatch.export_predispatch(module, (x,))
    assert module.cache == {}
    copy.deepcopy(module)
    torch.testing.assert_close(ep.module()(x), module(x))


class _AutocastWithoutDtypeInside(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.float16):
            with torch.autocast("cpu"):  # takes float16 from the block around it
                return self.lin(x)


def test_an_autocast_without_dtype_inside_the_same_autocast_is_not_a_region():
    """G3: a block identical to the enclosing one at run time is not a region."""
    ep = assert_matches_eager(_AutocastWithoutDtypeInside(), (torch.randn(2, 4),))
    assert [(r.depth, r.args) for r in predispatch.regions(ep)] == [(0, ("cpu", torch.float16, True, True))]


# Updates in the code that runs in the caller's grad mode (outside every grad
# block). Under a caller's no_grad, eager keeps the updated tensor's history,
# as inside a no_grad block: keep_history_if_no_grad(old, new) is new's
# history in grad mode and old's under no_grad.

class _ParameterUpdatedThenReadWithGrad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        self.p.mul_(2)  # eager: allowed on a leaf under the caller's no_grad only
        with torch.enable_grad():
            return self.p * x


class _InputUpdatedThenReadWithGrad(torch.nn.Module):
    def forward(self, x):
        x.mul_(2)
        with torch.enable_grad():
            return x * 3


class _ViewOfAGradTensorUpdated(torch.nn.Module):
    def forward(self, x):
        with torch.enable_grad():
            v0 = x.sin()
            v1 = v0[0]
        v1.mul_(3)
        return v0


class _UpdatedInsideALibraryCall(torch.nn.Module):
    def forward(self, x):
        with torch.enable_grad():
            h = x * 2 - 1
        torch.nn.functional.relu(h, inplace=True)  # mutated where only functionalization sees it
        return h


class _UpdatedInTheCallersModeThenUnderNoGrad(torch.nn.Module):
    def forward(self, x):
        with torch.enable_grad():
            h = x.cos()
        h.add_(1)
        with torch.no_grad():
            h.mul_(2)
        with torch.enable_grad():
            return h * x


@pytest.mark.parametrize("module, grad_modes", [
    (_ParameterUpdatedThenReadWithGrad, (False,)),
    (_InputUpdatedThenReadWithGrad, (False,)),
    (_ViewOfAGradTensorUpdated, (True, False)),
    (_UpdatedInsideALibraryCall, (True, False)),
    (_UpdatedInTheCallersModeThenUnderNoGrad, (True, False)),
])
def test_an_update_in_the_callers_mode_keeps_history_under_a_no_grad_caller(module, grad_modes):
    ep = assert_matches_eager(module(), (torch.randn(3, 4) if module is not _ParameterUpdatedThenReadWithGrad
                                         else torch.randn(3),), grad_modes=grad_modes)
    targets = [n.target for n in ep.graph.nodes]
    assert torch.ops.predispatch.keep_history_if_no_grad.default in targets


def test_an_update_in_the_callers_mode_read_only_there_needs_no_kept_history():
    """A later read in the caller's mode has no history under no_grad anyway."""
    class M(torch.nn.Module):
        def forward(self, x):
            with torch.enable_grad():
                h = x * 2
            h.add_(1)
            return h * 3

    ep = assert_matches_eager(M(), (torch.randn(3),))
    assert torch.ops.predispatch.keep_history_if_no_grad.default not in [n.target for n in ep.graph.nodes]


def _library_style(body):
    """A function like ``nn.init.constant_``: under any torch-function mode it
    is reached through ``handle_torch_function``, so its body runs with every
    torch-function mode off (the tracer's and the recorder's)."""
    def call(t, *rest):
        if torch.overrides.has_torch_function_unary(t):
            return torch.overrides.handle_torch_function(call, (t,), t, *rest)
        return body(t, *rest)
    return call


def _scaled_with_grad(t, w):
    with torch.enable_grad():
        return t * w


_scaled_with_grad = _library_style(_scaled_with_grad)


class _InitInTheForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))
        self.v = torch.nn.Parameter(torch.randn(4))
        self.register_buffer("b", torch.ones(4))

    def forward(self, x):
        torch.nn.init.constant_(self.w, 0.5)  # with torch.no_grad(): w.fill_(0.5)
        torch.nn.init.zeros_(self.v[:2])
        torch.nn.init.ones_(self.b)
        return x * self.w + self.v * self.b


class _GradOnInsideALibraryCall(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        with torch.no_grad():
            y = _scaled_with_grad(x, self.w)  # has a history, as in eager
        return y, y * 2


@pytest.mark.parametrize("module", [_InitInTheForward, _GradOnInsideALibraryCall])
def test_grad_mode_blocks_inside_library_calls_are_regions(module):
    """The tracer's torch-function modes do not see the block inside: it is
    marked where its first op runs, restored where the next op after it runs."""
    ep = assert_matches_eager(module(), (torch.randn(4, requires_grad=True),))
    assert [args for _, _, args in region_tree(ep.graph_module)]


def _leaves_grad_off(t):
    torch.set_grad_enabled(False)
    return t * 2


class _LeavesGradOffInALibraryCall(torch.nn.Module):
    def forward(self, x):
        return _library_style(_leaves_grad_off)(x) + 1


def test_grad_mode_left_changed_by_a_library_call_is_refused():
    with pytest.raises(predispatch.ExportError, match=r"library call at .*test_core.py:\d+ in _leaves_grad_off"):
        predispatch.export_predispatch(_LeavesGradOffInALibraryCall(), (torch.randn(4),))
    assert torch.is_grad_enabled()


class _LeafFromNoGrad(torch.nn.Module):
    """'differentiate from here': a value computed under no_grad made a leaf."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):
        with torch.no_grad():
            h = x * self.w
        h.requires_grad_()
        return h, h * 2


class _LeavesMadeInTheForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):
        bias = torch.ones(3, requires_grad=True)
        d = (x * 3).detach()
        d.requires_grad = True
        self.w.requires_grad_()  # already requires grad: nothing changes
        return x * self.w, bias * 2, d + 1


class _InputsRequireGradHook(torch.nn.Module):
    """transformers' enable_input_require_grads: a frozen embedding's output is
    made to require grad (for reentrant checkpointing with adapters)."""

    def __init__(self, frozen_linear=False):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4).requires_grad_(False)
        self.lin = torch.nn.Linear(4, 4).requires_grad_(not frozen_linear)
        self.emb.register_forward_hook(lambda module, args, out: out.requires_grad_(True))

    def forward(self, ids):
        return self.lin(self.emb(ids))


@pytest.mark.parametrize("module, args, seen", [
    (_LeafFromNoGrad(), (torch.randn(3),), True),
    (_LeavesMadeInTheForward(), (torch.randn(3),), True),
    (_InputsRequireGradHook(frozen_linear=True), (torch.tensor([[1, 2, 3]]),), True),
    # the embedding's history cannot be seen: the linear's parameters give the output one
    (_InputsRequireGradHook(), (torch.tensor([[1, 2, 3]]),), False),
])
def test_tensors_made_to_require_grad_in_the_forward(module, args, seen):
    """The trace, above autograd, has no node for requires_grad_(): the
    program's ``predispatch.requires_grad`` keeps a history, or starts one,
    where an output can show it."""
    ep = assert_matches_eager(module, args)
    assert seen == (torch.ops.predispatch.requires_grad.default in {
        n.target for m in all_graph_modules(ep.graph_module) for n in m.graph.nodes})


def test_a_leaf_output_gets_its_gradient():
    ep = predispatch.export_predispatch(_LeafFromNoGrad(), (torch.randn(3),))
    h, out = ep.module()(torch.randn(3))
    out.sum().backward()
    assert h.is_leaf and torch.equal(h.grad, torch.full((3,), 2.0))


class _InputMadeToRequireGrad(torch.nn.Module):
    def forward(self, x):
        x.requires_grad_()
        return x * 2


class _InputUpdatedThenMadeToRequireGrad(torch.nn.Module):
    def forward(self, a):
        a[:].add_(5)
        a.requires_grad = True
        return a.sum()


@pytest.mark.parametrize("module", [_InputMadeToRequireGrad, _InputUpdatedThenMadeToRequireGrad])
def test_requires_grad_set_on_an_input_is_refused(module):
    """Also once updated in place (torch's test_autograd
    test_no_requires_grad_inplace: the program silently gave the input no
    .grad)."""
    with pytest.raises(predispatch.ExportError, match=r"requires_grad set on a parameter, buffer or input at .*test_core.py:\d+"):
        predispatch.export_predispatch(module(), (torch.randn(3),))


class _MaskRequiringGrad(torch.nn.Module):
    """T5 under gradient checkpointing: ``position_bias.requires_grad = True``."""

    def __init__(self):
        super().__init__()
        self.q, self.kv = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x, y):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 8).transpose(1, 2)
        k = self.kv(y).view(b, y.shape[1], 4, 8).transpose(1, 2)
        bias = torch.zeros(1, 4, s, y.shape[1])
        bias.requires_grad = True
        out = torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=bias)
        return out.transpose(1, 2).reshape(b, s, -1)


def test_a_leaf_no_output_shows_is_not_made():
    """A mask that requires grad sends sdpa down another kernel, with another
    output layout than the trace assumed (the reshape after it would fail)."""
    assert_matches_eager(_MaskRequiringGrad(), (torch.randn(2, 6, 32), torch.randn(2, 8, 32)))


class _ScaledUnderNoGrad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            y.mul_(2)  # y keeps its history; forward-mode AD sees the update
        return y


def test_forward_mode_ad_through_a_kept_history():
    import torch.autograd.forward_ad as fwAD

    module, x = _ScaledUnderNoGrad(), torch.randn(3, 4)
    ep = predispatch.export_predispatch(module, (x,))

    def tangent(mod):
        with fwAD.dual_level():
            return fwAD.unpack_dual(mod(fwAD.make_dual(x, torch.ones_like(x)))).tangent
    torch.testing.assert_close(tangent(ep.module()), tangent(module))


class _AliasingLeafUpdated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(3))

    def forward(self, x):
        h = self.b.detach().requires_grad_()  # shares the buffer's memory
        with torch.no_grad():
            self.b.add_(1)
        return x * h


class _ViewOfAnAliasingLeaf(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        h = y.detach().requires_grad_()  # a leaf sharing y's memory
        row = h[0]  # its view, replayed from y's storage once y is updated
        y.add_(1)
        return row * 3, h.unsqueeze(0)


def test_a_leaf_sharing_memory_reads_the_memory_as_it_is():
    """Reads of the leaf (and of its grad-mode views) are reads of the current
    memory through predispatch.requires_grad, whatever replays them."""
    assert_matches_eager(_AliasingLeafUpdated(), (torch.randn(3),))
    assert_matches_eager(_ViewOfAnAliasingLeaf(), (torch.randn(2, 3),))
