"""Fake kernels that skip torch's Python decompositions (_torch/fake_kernels.py):
each gives the outputs torch's own fake path gives, where it is used at all."""
import itertools
import unittest
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import predispatch
import predispatch.testing
from predispatch import _torch
from predispatch._torch import fake_kernels

aten = torch.ops.aten
TRAINING = aten._native_batch_norm_legit_functional.default
INFERENCE = aten._native_batch_norm_legit_no_training.default

# input layouts: (shape, the permutation its memory is laid out in, a slice making it not dense)
LAYOUTS = {
    "2d": ((4, 3), (0, 1), False),
    "3d": ((2, 3, 5), (0, 1, 2), False),
    "3d channels last": ((2, 3, 5), (0, 2, 1), False),
    "4d": ((2, 3, 4, 5), (0, 1, 2, 3), False),
    "4d channels last": ((2, 3, 4, 5), (0, 2, 3, 1), False),
    "4d spatial transposed": ((2, 3, 4, 5), (0, 1, 3, 2), False),
    "5d channels last": ((2, 3, 2, 4, 5), (0, 2, 3, 4, 1), False),
    "batch of one": ((1, 3, 4, 5), (0, 1, 2, 3), False),
    "one pixel": ((2, 3, 1, 1), (0, 1, 2, 3), False),
    "one pixel, channels last": ((2, 3, 1, 1), (0, 2, 3, 1), False),
    "one channel": ((2, 1, 4, 5), (0, 1, 2, 3), False),
    "one value per channel": ((1, 3), (0, 1), False),
    "not dense": ((2, 3, 4, 5), (0, 1, 2, 3), True),
}
# the layouts other axes (dtypes, devices, arguments) are crossed with: one the rules
# take, one whose strides order the dimensions otherwise, one they refuse (sizes of one)
FEW_LAYOUTS = ("2d", "4d channels last", "one pixel")
DTYPES = {  # input, weight and statistics
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp16, fp32 weights": (torch.float16, torch.float32),
    "fp64": (torch.float64, torch.float64),
}


def _fake(mode, shape, dtype, device, order=None, sliced=False):
    order = order or tuple(range(len(shape)))
    laid = torch.empty([shape[d] * (2 if sliced and d == order[-1] else 1) for d in order],
                       dtype=dtype, device="meta")
    t = laid.permute(tuple(order.index(d) for d in range(len(shape))))
    if sliced:
        t = t.narrow(order[-1], 0, shape[order[-1]])
    return mode.fake_tensor_converter.from_meta_and_device(mode, t, torch.device(device))


def _metadata(out):  # sizes and strides as written: symbolic ones by their expressions
    return [(str(tuple(t.shape)), str(t.stride()), t.dtype, t.device, str(t.storage_offset())) for t in out]


def _outputs(op, args, fast: bool):
    """The op's outputs' metadata on fake tensors (or the error), and whether a fast kernel made them."""
    used = []
    real_kernel = fake_kernels._fast_kernel

    def counting(*a):
        out = real_kernel(*a)
        used.append(out is not NotImplemented)
        return out

    mode = args[0].fake_mode
    FakeTensorMode.cache_clear()
    with mock.patch.object(fake_kernels, "_fast_kernel", counting):
        with (fake_kernels.fast_fake_kernels() if fast else mock.patch.dict({})), mode:
            try:
                result = _metadata(op(*args))
            except Exception as e:  # noqa: BLE001  (compared: both ways must fail alike)
                result = type(e)
    FakeTensorMode.cache_clear()
    return result, any(used)


class TestBatchNormKernels(unittest.TestCase):
    def _check(self, op, layout, dtypes, device, weights, extra):
        shape, order, sliced = LAYOUTS[layout]
        x_dtype, w_dtype = DTYPES[dtypes]
        mode = FakeTensorMode()
        x = _fake(mode, shape, x_dtype, device, order, sliced)
        vector = lambda: _fake(mode, (shape[1],), w_dtype, device)  # noqa: E731
        args = (x, *(vector() if present else None for present in weights), vector(), vector(), *extra)
        torch_way, _ = _outputs(op, args, fast=False)
        ours, fast = _outputs(op, args, fast=True)
        self.assertEqual(ours, torch_way)
        return fast

    def test_each_output_is_torchs(self):
        """Every input layout, dtype mix, device and weight/bias presence: the
        outputs' sizes, strides, dtypes and devices are those torch's
        decomposition gives (or both fail alike); the fast kernel is used
        where the input's strides order its dimensions alone."""
        used = {}
        # every layout in fp32 on the CPU with weights; the dtype mixes, devices and weights on a few layouts
        # (the rule's layout test, ``_usable``, reads no dtype or device)
        grid = [*itertools.product(LAYOUTS, ["fp32"], ["cpu"], [(True, True)]),
                *itertools.product(FEW_LAYOUTS, DTYPES, ("cpu", "cuda"), ((True, True), (True, False)))]
        for op, (layout, dtypes, device, weights) in itertools.product((TRAINING, INFERENCE), dict.fromkeys(grid)):
            extra = (True, 0.1, 1e-5) if op is TRAINING else (0.1, 1e-5)
            with self.subTest(op=op.__name__, layout=layout, dtypes=dtypes, device=device, weights=weights):
                used.setdefault((op, layout), set()).add(self._check(op, layout, dtypes, device, weights, extra))
        fast = {"2d", "3d", "3d channels last", "4d", "4d channels last", "4d spatial transposed",
                "5d channels last", "batch of one"}  # the rest: strides tie, or not dense
        self.assertEqual(set().union(*used.values()), {True, False})
        self.assertEqual({layout for (op, layout), taken in used.items() if taken == {True} and op is TRAINING}, fast)
        self.assertEqual({layout for (op, layout), taken in used.items() if taken == {True} and op is INFERENCE},
                         fast | {"one value per channel"})
        self.assertEqual({layout for (op, layout), taken in used.items() if taken == {False}},
                         set(LAYOUTS) - fast)  # training divides by n - 1 = 0 there

    def test_symbolic_sizes_outputs_and_guards_are_torchs(self):
        """Every input layout with the batch, every dimension but the channels,
        or the spatial ones dynamic: outputs as torch's decomposition writes
        them, and the same guards and ranges in the shape env after; the
        rule is used where no stride is symbolic (the batch dimension
        outermost: its size is in no stride)."""
        def symbolic(shape, order, sliced, dynamic, dtype, fast):
            x = _symbolic_fake(shape, order, sliced, dynamic, dtype)
            self.assertTrue(x._has_symbolic_sizes_strides)
            mode = x.fake_mode
            vector = lambda: mode.from_tensor(torch.empty(shape[1], dtype=dtype), static_shapes=True)  # noqa: E731
            guards_before = len(mode.shape_env.guards)
            with mode:  # weights as a module's parameters: static
                args = (x, vector(), vector(), vector(), vector(), *extra)
            out, used = _outputs(op, args, fast)
            return (out, *_shape_env_after(mode, guards_before)), used

        used = {}
        dynamics = {"batch": lambda n: {0}, "all but channels": lambda n: set(range(n)) - {1},
                    "spatial": lambda n: set(range(2, n))}
        grid = [*itertools.product(LAYOUTS, dynamics, [torch.float32]),  # bf16 on a few layouts
                *itertools.product(FEW_LAYOUTS, dynamics, [torch.bfloat16])]
        for op, (layout, dynamic, dtype) in itertools.product((TRAINING, INFERENCE), grid):
            shape, order, sliced = LAYOUTS[layout]
            dims = {d for d in dynamics[dynamic](len(shape)) if shape[d] > 1}  # a size of 1 stays static
            if not dims:
                continue
            extra = (True, 0.1, 1e-5) if op is TRAINING else (0.1, 1e-5)
            with self.subTest(op=op.__name__, layout=layout, dynamic=dynamic, dtype=dtype):
                torch_way, _ = symbolic(shape, order, sliced, dims, dtype, fast=False)
                ours, fast = symbolic(shape, order, sliced, dims, dtype, fast=True)
                self.assertEqual(ours, torch_way)
                used.setdefault((op.__name__, layout, dynamic), set()).add(fast)
        by_rule = {key for key, taken in used.items() if taken == {True}}
        self.assertEqual({key for key, taken in used.items() if taken == {False}}, set(used) - by_rule)
        static_strides = {"2d", "3d", "3d channels last", "4d", "4d channels last", "4d spatial transposed",
                          "5d channels last"}  # a batch of one is not dynamic
        self.assertFalse({key for key in by_rule if key[2] == "spatial"})  # a spatial size is in a stride
        for op in (TRAINING, INFERENCE):  # the batch alone dynamic: by rule wherever the static rule applies
            self.assertEqual({layout for name, layout, dynamic in by_rule if name == op.__name__ and dynamic == "batch"},
                             static_strides)

    def test_training_false_through_the_functional_op_is_torchs(self):
        mode = FakeTensorMode()
        x, v = _fake(mode, (2, 3, 4, 5), torch.float32, "cpu"), lambda: _fake(mode, (3,), torch.float32, "cpu")
        args = (x, v(), v(), v(), v(), False, 0.1, 1e-5)
        torch_way, _ = _outputs(TRAINING, args, fast=False)
        ours, fast = _outputs(TRAINING, args, fast=True)
        self.assertEqual(ours, torch_way)
        self.assertFalse(fast)


def _meta(shape, dtype, order=None, sliced=False):
    order = order or tuple(range(len(shape)))
    laid = torch.empty([shape[d] * (2 if sliced and d == order[-1] else 1) for d in order], dtype=dtype, device="meta")
    t = laid.permute(tuple(order.index(d) for d in range(len(shape))))
    return t.narrow(order[-1], 0, shape[order[-1]]) if sliced else t


class TestMetaBatchNorm(unittest.TestCase):
    """``aten.batch_norm`` on meta tensors (a layer's replay) by rule."""

    def test_each_output_is_the_meta_kernels(self):
        """Every layout, dtype mix (weights and statistics of another dtype
        too), training or not, with or without weights and statistics: the
        rule's output is the meta kernel's (sizes, strides, offset, dtype),
        and where the meta kernel fails the rule is not used."""
        used = set()
        for layout, dtypes, training, weights, stats in itertools.product(
                LAYOUTS, DTYPES, (True, False), (True, False), (True, False)):
            shape, order, sliced = LAYOUTS[layout]
            x_dtype, w_dtype = DTYPES[dtypes]
            x = _meta(shape, x_dtype, order, sliced)
            vector = lambda: _meta((shape[1],), w_dtype)  # noqa: E731
            args = (x, *((vector(), vector()) if weights else (None, None)),
                    *((vector(), vector()) if stats else (None, None)), training, 0.1, 1e-5, False)
            with self.subTest(layout=layout, dtypes=dtypes, training=training, weights=weights, stats=stats), \
                    predispatch._torch.below_autograd():
                try:
                    expected = _metadata([aten.batch_norm.default(*args)])
                except Exception as e:  # noqa: BLE001  (the rule must then not be used)
                    expected = type(e)
                out = fake_kernels.by_meta_rule(aten.batch_norm.default, args, {})
                if out is not NotImplemented:
                    used.add(layout)
                    self.assertEqual(_metadata([out]), expected)
        self.assertEqual(used, {"2d", "3d", "3d channels last", "4d", "4d channels last", "4d spatial transposed",
                                "5d channels last", "batch of one", "one value per channel"})

    def test_a_replay_runs_it(self):
        """Under :func:`meta_rules` the meta kernel does not run where the rule holds."""
        x, v = _meta((2, 3, 4, 5), torch.float32), _meta((3,), torch.float32)
        rule = mock.Mock(wraps=fake_kernels._meta_batch_norm)
        with mock.patch.dict(fake_kernels.META_KERNELS, {aten.batch_norm.default: rule}), \
                predispatch._torch.below_autograd(), fake_kernels.meta_rules():
            out = torch.nn.functional.batch_norm(x, v, v, v, v, training=True)
        self.assertEqual(rule.call_count, 1)
        self.assertEqual((out.shape, out.stride()), (x.shape, x.stride()))

ACTIVATIONS = {  # op -> its scalar arguments, as calls pass them (gelu's approximation: a keyword)
    aten.relu.default: [()], aten.gelu.default: [(), {"approximate": "tanh"}, {"approximate": "none"}],
    aten.hardtanh.default: [(), (0.0, 6.0), (6, 0)], aten.hardswish.default: [()], aten.hardsigmoid.default: [()],
    aten.leaky_relu.default: [(), (0.2,)], aten.elu.default: [(), (1.0, 1.0, 2.0)], aten.mish.default: [()],
    aten.softplus.default: [(), (2.0, 10.0)],
}
EVERY_LAYOUT = (aten.relu.default, aten.gelu.default)  # the rest on FEW_LAYOUTS


def _symbolic_fake(shape, order, sliced, dynamic, dtype, mode=None):
    """A fake tensor laid out as ``order`` says, the dimensions in ``dynamic``
    symbolic (a size of 1 stays static), in ``mode`` (or a new one with a shape env)."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = mode or FakeTensorMode(shape_env=ShapeEnv())
    laid = torch.empty([shape[d] * (2 if sliced and d == order[-1] else 1) for d in order], dtype=dtype)
    real = laid.permute(tuple(order.index(d) for d in range(len(shape))))
    real = real.narrow(order[-1], 0, shape[order[-1]]) if sliced else real
    sizes = [DimDynamic.DYNAMIC if d in dynamic else DimDynamic.STATIC for d in range(len(shape))]
    return mode.from_tensor(real, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))


def _shape_env_after(mode, guards_before: int) -> tuple:
    env = mode.shape_env
    return ([str(g.expr) for g in env.guards[guards_before:]], str(env.replacements),
            str(sorted((str(k), str(v)) for k, v in env.var_to_range.items())))


class TestActivationKernels(unittest.TestCase):
    def test_each_output_is_torchs(self):
        """Each activation in KERNELS, with each way its scalars are passed,
        on every input layout in fp32 (bf16 and int64, and every dimension
        symbolic, on three), static and with the batch symbolic: its output's
        metadata is that of torch's path (its meta kernel, or its Python
        decomposition at symbolic sizes), with the same guards; the rule is
        used wherever the input's strides order its dimensions alone."""
        self.assertEqual(set(ACTIVATIONS), {op for op, k in fake_kernels.KERNELS.items()
                                            if k is fake_kernels._activation})
        dynamics = {"static": lambda n: set(), "batch": lambda n: {0}, "all": lambda n: set(range(n))}
        few = FEW_LAYOUTS
        grid = [*itertools.product(LAYOUTS, [torch.float32], ("static", "batch")),  # the rest on a few layouts
                *itertools.product(few, [torch.float32], ["all"]),
                *itertools.product(few, (torch.bfloat16, torch.int64), ("static", "batch"))]
        used = {}
        for (op, calls), (layout, dtype, dynamic) in itertools.product(ACTIVATIONS.items(), grid):
            if op not in EVERY_LAYOUT and layout not in few:
                continue  # one rule serves every activation: the layouts on a few of them
            shape, order, sliced = LAYOUTS[layout]
            dims = {d for d in dynamics[dynamic](len(shape)) if shape[d] > 1}
            if dynamic != "static" and not dims:
                continue
            # the scalars' ways are told apart by the op, not the layout or dtype: the others on a few fp32 layouts
            for call in calls if layout in few and dtype is torch.float32 and dynamic != "all" else calls[:1]:
                args, kwargs = ((), call) if isinstance(call, dict) else (call, {})
                with self.subTest(op=op.__name__, layout=layout, dtype=dtype, dynamic=dynamic, call=call):
                    outcomes = []
                    for fast in (False, True):
                        x = _symbolic_fake(shape, order, sliced, dims, dtype)
                        before = len(x.fake_mode.shape_env.guards)
                        spec = (op, (x, *args, kwargs)) if kwargs else (op, (x, *args))
                        dispatched = []
                        out = _outcome(*spec, fast, dispatched)
                        outcomes.append((out, _shape_env_after(x.fake_mode, before), dispatched))
                    (torch_way, torch_env, _), (ours, our_env, our_dispatched) = outcomes
                    self.assertEqual((ours, our_env), (torch_way, torch_env))
                    # by rule: no fake kernel of torch's ran (the rule comes before them)
                    used.setdefault((op, layout, dtype, dynamic), set()).add(not our_dispatched)
        one_order = {"2d", "3d", "3d channels last", "4d", "4d channels last", "4d spatial transposed",
                     "5d channels last", "batch of one", "one value per channel"}
        by_rule = {key for key, taken in used.items() if taken == {True}}
        expected = {"static": one_order, "batch": one_order - {"batch of one", "one value per channel"},  # not dynamic
                    "all": {"2d"}}  # symbolic strides: row-major ones only (each the later sizes' product)
        for op, dynamic in itertools.product(EVERY_LAYOUT, dynamics):
            self.assertEqual({layout for o, layout, dtype, d in by_rule if (o, d, dtype) == (op, dynamic, torch.float32)},
                             expected[dynamic])
        self.assertEqual({dtype for *_, dtype, _ in by_rule}, {torch.float32, torch.bfloat16})  # not an integer


def _fakes_in_one_mode(specs):
    """Fake tensors in one new mode with a shape env: each spec (shape, the
    dimensions symbolic, dtype, transposed: laid out in reverse order)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    tensors = []
    for shape, dynamic, dtype, transposed in specs:
        if shape == "rows of the first":  # a vector as long as the first tensor's rows: its size, symbol and all
            with mode:
                tensors.append(torch.empty(tensors[0].shape[0], dtype=dtype))
            continue
        order = tuple(range(len(shape)))
        tensors.append(_symbolic_fake(shape, order[::-1] if transposed else order, False, dynamic, dtype, mode))
    return mode, tensors


def _symbolic_cases():
    """(op, tensor specs, other arguments, keyword arguments) for the rules of
    ops fake mode decomposes at symbolic sizes only."""
    for shape, transposed, dynamic, dtype in itertools.product(
            ((4, 10), (2, 3, 4, 5)), (False, True), ("batch", "all"), (torch.float32, torch.bfloat16, torch.float16)):
        dims = {0} if dynamic == "batch" else set(range(len(shape)))
        x = (shape, dims, dtype, transposed)
        yield aten._log_softmax.default, [x], (-1, True), {}  # half to float: a half input only
        if dtype is torch.float16:
            continue
        # the dims on fp32; bf16 (its own output dtype) on the last and the one out of range
        for dim in (1, -1, len(shape)) if dtype is torch.float32 else (-1, len(shape)):  # the last: out of range
            yield aten._log_softmax.default, [x], (dim, False), {}
            yield aten._safe_softmax.default, [x], (dim,), {}
            if dim == -1:  # a dtype given: its own output dtype, apart from the dim
                yield aten._safe_softmax.default, [x], (dim, torch.float32), {}
    for (bias, m2, m2_transposed, dtypes), (beta, alpha), dynamic in itertools.product(
            [((6,), (8, 6), False, (torch.float32,) * 3), ((6,), (8, 6), True, (torch.bfloat16,) * 3),
             ((4, 6), (8, 6), False, (torch.float32,) * 3), ((1, 6), (8, 6), False, (torch.float32,) * 3),
             ((6,), (8, 6), False, (torch.float32, torch.bfloat16, torch.bfloat16)),
             ((6,), (9, 6), False, (torch.float32,) * 3)],  # sizes that do not fit
            ((1, 1), (0, 1), (0.5, 2)), ("batch", "batch and inner", "the weight's")):
        if (beta, alpha) != (1, 1) and (bias, m2_transposed, dtypes) != ((6,), False, (torch.float32,) * 3):
            continue  # beta and alpha (values only) crossed with the first's shapes alone
        m1_dims = {"batch": {0}, "batch and inner": {0, 1}, "the weight's": set()}[dynamic]
        specs = [(bias, set(), dtypes[0], False), ((4, 8), m1_dims, dtypes[1], False),
                 (m2, {0} if dynamic == "the weight's" else set(), dtypes[2], m2_transposed)]
        yield aten.addmm.default, specs, (), ({} if (beta, alpha) == (1, 1) else {"beta": beta, "alpha": alpha})
    rows = ("rows of the first", None, torch.long, False)
    for (dims, target, dtype, weighted), reduction, ignore in itertools.product(
            [({0}, rows, torch.float32, False), ({0}, rows, torch.float32, True), ({0}, rows, torch.bfloat16, False),
             ({0, 1}, rows, torch.float32, False),  # the classes symbolic
             ({0}, ((6,), {0}, torch.long, False), torch.float32, False),  # a target of a size of its own
             ({0}, rows, torch.float32, "of another dtype")],
            (0, 1, 2), (-100, 1)):
        if (reduction, ignore) != (1, -100) and (dims, dtype, weighted) != ({0}, torch.float32, False):
            continue  # the reductions and ignored index (outputs' sizes only) on the first's inputs alone
        weight = [((4,), set(), torch.float64 if weighted == "of another dtype" else dtype, False)] if weighted else []
        specs = [((6, 4), dims, dtype, False), target, *weight]
        yield aten.nll_loss_forward.default, specs, ((None,) if not weighted else ()) + (reduction, ignore), {}


class TestSymbolicSizeRules(unittest.TestCase):
    def test_each_output_is_torchs(self):
        """_log_softmax, _safe_softmax, addmm and nll_loss_forward at symbolic
        sizes, where fake mode runs their Python decompositions: over shapes,
        layouts, dims (one out of range), dtypes and arguments, the outputs'
        metadata and the failures are torch's, with the same guards; the rule
        is used where the input is contiguous with static strides (the batch
        alone dynamic), for addmm where the bias is a row and the dtypes agree,
        for nll_loss_forward where the target's size is the input's rows' own."""
        used = {}
        for op, specs, rest, kwargs in _symbolic_cases():
            with self.subTest(op=op.__name__, specs=specs, rest=rest, kwargs=kwargs):
                outcomes = []
                for fast in (False, True):
                    mode, tensors = _fakes_in_one_mode(specs)
                    before = len(mode.shape_env.guards)
                    dispatched = []
                    args = (*tensors, *rest, kwargs) if kwargs else (*tensors, *rest)
                    outcomes.append((_outcome(op, args, fast, dispatched), _shape_env_after(mode, before),
                                     dispatched))
                (torch_way, torch_env, _), (ours, our_env, our_dispatched) = outcomes
                self.assertEqual((ours, our_env), (torch_way, torch_env))
                used.setdefault(op, []).append(not our_dispatched)  # by rule: no fake kernel of torch's ran
        self.assertEqual({op for op, taken in used.items() if True in taken and False in taken},
                         {aten._log_softmax.default, aten._safe_softmax.default, aten.addmm.default,
                          aten.nll_loss_forward.default})


def _spec(shape, dtype=torch.float32, transposed=False):
    return (tuple(shape), dtype, transposed)


def _made(mode, spec, device):
    shape, dtype, transposed = spec
    if dtype is torch.long:
        return mode.fake_tensor_converter.from_meta_and_device(
            mode, torch.empty(shape, dtype=dtype, device="meta"), torch.device(device))
    return _fake(mode, shape, dtype, device, order=tuple(range(len(shape)))[::-1] if transposed else None)


def _meta_kernel_cases():
    """(op, inputs as specs or values, keyword arguments last as a dict), each
    op across shapes, layouts, dtypes and arguments."""
    floats = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    for n, p, dtype, (beta, alpha) in itertools.product((1, 3), (1, 5), floats, ((1, 1), (0, 1), (0.5, 2))):
        for bias in ((p,), (n, p), (n, 1), ()):
            for t1, t2 in ((False, False), (False, True), (True, True)):
                if ((beta, alpha) == (1, 1)) == ((t1, t2) != (False, True)):
                    yield aten.addmm.default, (_spec(bias, dtype), _spec((n, 4), dtype, t1), _spec((4, p), dtype, t2),
                                               {"beta": beta, "alpha": alpha})
    for mixed in ((torch.bfloat16, torch.float32, torch.float32), (torch.float32, torch.bfloat16, torch.bfloat16),
                  (torch.float32, torch.float32, torch.float16)):
        yield aten.addmm.default, (_spec((5,), mixed[0]), _spec((3, 4), mixed[1]), _spec((4, 5), mixed[2]))
    yield aten.addmm.default, (_spec((5,)), _spec((3, 4)), _spec((3, 5)))  # sizes that do not fit
    for dtype, transposed, dim in itertools.product(floats, (False, True), (0, 1, -1)):
        yield aten._log_softmax.default, (_spec((3, 4, 5), dtype, transposed), dim, False)
        yield aten._safe_softmax.default, (_spec((3, 4, 5), dtype, transposed), dim)
        yield aten._safe_softmax.default, (_spec((3, 4, 5), dtype, transposed), dim, torch.float32)
    for dtype, reduction, ignore, weighted in itertools.product(floats, (0, 1, 2), (-100, 1), (False, True)):
        for logits, target in (((6, 4), (6,)), ((4,), ())):
            weight = _spec((4,), dtype) if weighted else None
            yield aten.nll_loss_forward.default, (_spec(logits, dtype), _spec(target, torch.long), weight,
                                                  reduction, ignore)


def _outcome(op, args, fast: bool, dispatched: list):
    """The outputs' metadata and which input each shares memory with, or the
    error's type; each op fake mode computed meanwhile appended to ``dispatched``
    (a Python decomposition's ops after the op's own)."""
    kwargs = args[-1] if isinstance(args[-1], dict) else {}
    args = args[:-1] if kwargs else args
    mode = next(a for a in args if isinstance(a, torch.Tensor)).fake_mode
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    original = FakeTensorMode._dispatch_impl

    def counted(self, func, *rest):
        dispatched.append(func)
        return original(self, func, *rest)

    FakeTensorMode.cache_clear()
    try:
        # torch logs a failing fake kernel's traceback (failures are compared here): quiet, as in an export
        with mock.patch.object(FakeTensorMode, "_dispatch_impl", counted), _torch.fake_tensor_log_quiet(), \
                (fake_kernels.fast_fake_kernels() if fast else mock.patch.dict({})), mode:
            out = op(*args, **kwargs)
        out = out if isinstance(out, tuple) else (out,)
        return [(*_metadata([t])[0], [i for i, a in enumerate(inputs)
                                      if a.untyped_storage()._cdata == t.untyped_storage()._cdata]) for t in out]
    except Exception as e:  # noqa: BLE001  (compared)
        return type(e)
    finally:
        FakeTensorMode.cache_clear()


# view inputs: (shape, the permutation its memory is laid out in, a slice making it not dense, a storage offset)
VIEW_INPUTS = {
    "2d": ((4, 6), (0, 1), False, 0),
    "3d": ((2, 3, 4), (0, 1, 2), False, 0),
    "sizes of one": ((2, 1, 3, 1), (0, 1, 2, 3), False, 0),
    "at an offset": ((4, 6), (0, 1), False, 6),
    "empty": ((0, 4), (0, 1), False, 0),
    "scalar": ((), (), False, 0),
    "transposed": ((4, 6), (1, 0), False, 0),
    "contiguous, sizes of one laid out otherwise": ((2, 3, 1, 1), (0, 2, 3, 1), False, 0),
    "not dense": ((4, 6), (0, 1), True, 0),
}
ROW_MAJOR = {"2d", "3d", "sizes of one", "at an offset", "empty", "scalar"}


def _view_input(layout: str, dynamic: set):
    shape, order, sliced, offset = VIEW_INPUTS[layout]
    if offset:  # row-major, from the offset on: the rows after the first of a larger tensor
        (rows, cols), mode = shape, FakeTensorMode()
        return mode.from_tensor(torch.empty(rows + offset // cols, cols)[offset // cols:])
    return _symbolic_fake(shape, order, sliced, dynamic, torch.float32)


class TestViewKernels(unittest.TestCase):
    def test_each_output_is_torchs(self):
        """``view`` and ``_unsafe_view`` of every input layout to sizes that fit
        (-1 among them) and sizes that do not, static and with the first size
        symbolic: the output's sizes, strides, offset and memory are those of
        torch's path (or both fail alike), with the same guards; the rule is
        used where the input is laid out row-major at static sizes and the sizes fit."""
        used = {}
        for op, layout, dynamic in itertools.product((aten.view.default, aten._unsafe_view.default), VIEW_INPUTS,
                                                     ("static", "batch")):
            shape = VIEW_INPUTS[layout][0]
            dims = {0} if dynamic == "batch" and shape and shape[0] > 1 and layout != "at an offset" else set()
            if dynamic == "batch" and not dims:
                continue
            n = 1
            for size in shape:
                n *= size
            for size in ([-1], [n], [1, -1, 1], [2, -1], [-1, 2], [n + 1], [5, -1]):
                with self.subTest(op=op.__name__, layout=layout, dynamic=dynamic, size=size):
                    outcomes = []
                    for fast in (False, True):
                        x = _view_input(layout, dims)
                        env = x.fake_mode.shape_env
                        before = len(env.guards) if env is not None else 0
                        dispatched = []
                        out = _outcome(op, (x, size), fast, dispatched)
                        outcomes.append((out, _shape_env_after(x.fake_mode, before) if env is not None else None,
                                         dispatched))
                    (torch_way, torch_env, _), (ours, our_env, our_dispatched) = outcomes
                    self.assertEqual((ours, our_env), (torch_way, torch_env))
                    fits = not isinstance(torch_way, type)
                    if fits:  # a view: of the input's memory
                        self.assertEqual(torch_way[0][-1], [0])
                    used.setdefault((layout, dynamic, fits), set()).add(not our_dispatched)
        by_rule = {key for key, taken in used.items() if taken == {True}}
        self.assertEqual(by_rule, {(layout, "static", True) for layout in ROW_MAJOR})
        self.assertEqual(set().union(*used.values()), {True, False})

    def test_symbolic_sizes_outputs_and_guards_are_torchs(self):
        """At symbolic sizes, where torch's reference guards on the sizes as it
        goes: the views of row-major inputs that merge whole dimensions and
        split static ones are made by rule, the rest by torch's path, each with
        torch's outputs and guards."""
        for (shape, dims, order), views in SYMBOLIC_VIEWS.items():
            for i, (sizes, by_rule) in enumerate(views):
                for op in (aten.view.default, aten._unsafe_view.default):
                    with self.subTest(shape=shape, dims=dims, order=order, view=i, op=op.__name__):
                        outcomes = []
                        for fast in (False, True):
                            x = _symbolic_fake(shape, order, False, set(dims), torch.float32)
                            before = len(x.fake_mode.shape_env.guards)
                            dispatched = []
                            out = _outcome(op, (x, sizes(x.shape)), fast, dispatched)
                            outcomes.append((out, _shape_env_after(x.fake_mode, before), dispatched))
                        (torch_way, torch_env, _), (ours, our_env, our_dispatched) = outcomes
                        self.assertEqual((ours, our_env), (torch_way, torch_env))
                        self.assertEqual(not our_dispatched, by_rule)


# views at symbolic sizes: (shape, its symbolic dimensions, memory order) -> [(the sizes made
# from the fake input's, whether the rule makes the view: merges and static splits only)]
SYMBOLIC_VIEWS = {
    ((4, 6), (0,), (0, 1)): [
        (lambda s: [-1], True), (lambda s: [s[0], 2, 3], True), (lambda s: [s[0], -1], True),
        (lambda s: [-1, 6], True), (lambda s: [s[0] * 6], True),
        (lambda s: [-1, 2], False), (lambda s: [6, s[0]], False),  # a split across the symbolic size; a swap
        (lambda s: [s[0], 1, 6], False), (lambda s: [2, -1], False)],  # a size of one; a split of the symbol
    ((2, 3, 8), (0, 1), (0, 1, 2)): [  # the attention heads' split and merge, at a symbolic batch and length
        (lambda s: [s[0], s[1], 2, 4], True), (lambda s: [s[0] * s[1], 8], True), (lambda s: [s[0], -1], True),
        (lambda s: [-1, 2, 4], True), (lambda s: [s[0], s[1] * 8], True),
        (lambda s: [s[1], s[0], 8], False), (lambda s: [s[0], 2, -1], False)],
    ((4, 6), (0,), (1, 0)): [(lambda s: [-1], False), (lambda s: [s[0], 2, 3], False)],  # not row-major
}


class TestSymbolicRestrides(unittest.TestCase):
    def test_each_output_is_torchs(self):
        """permute, transpose, t and unsqueeze at symbolic sizes (torch's
        references: a few cached prims each), every dimension argument (out of
        range too) on row-major and transposed inputs: the outputs' sizes,
        strides, offset and memory, and the guards, are torch's path's; the
        rule is used wherever the arguments are valid."""
        used = {}
        for shape, dims, order in (((2, 5, 12, 8), {0, 1}, (0, 1, 2, 3)), ((2, 5, 12, 8), {0, 1}, (0, 2, 1, 3)),
                                   ((4, 6), {0, 1}, (1, 0)), ((3,), {0}, (0,))):
            n = len(shape)
            calls = [(aten.transpose.int, (a, b)) for a, b in itertools.product(range(-n - 1, n + 1), repeat=2)]
            calls += [(aten.permute.default, (list(p),)) for p in itertools.permutations(range(n))]
            calls += [(aten.permute.default, ([-1, *range(n - 1)],)), (aten.permute.default, ([0] * n,)),
                      (aten.t.default, ())]
            calls += [(aten.unsqueeze.default, (d,)) for d in range(-n - 2, n + 2)]
            for op, rest in calls:
                with self.subTest(shape=shape, order=order, op=op.__name__, args=rest):
                    outcomes = []
                    for fast in (False, True):
                        x = _symbolic_fake(shape, order, False, dims, torch.float32)
                        before = len(x.fake_mode.shape_env.guards)
                        dispatched = []
                        out = _outcome(op, (x, *rest), fast, dispatched)
                        outcomes.append((out, _shape_env_after(x.fake_mode, before), dispatched))
                    (torch_way, torch_env, _), (ours, our_env, our_dispatched) = outcomes
                    self.assertEqual((ours, our_env), (torch_way, torch_env))
                    fails = isinstance(torch_way, type)
                    used.setdefault((op, fails), set()).add(not our_dispatched)
        self.maxDiff = None
        self.assertEqual(used, {**{(op, False): {True} for op in (aten.transpose.int, aten.permute.default,
                                                                    aten.unsqueeze.default)},
                                (aten.t.default, False): {True, False},  # a vector's: torch's path
                                **{(op, True): {False} for op in (aten.transpose.int, aten.permute.default,
                                                                   aten.unsqueeze.default, aten.t.default)}})


class TestSymbolicMean(unittest.TestCase):
    def test_each_output_is_torchs(self):
        """mean over one or two dimensions (negative ones, one given twice), with
        and without keepdim, of its dtype or another, at symbolic sizes, on
        row-major fp32 and bf16 inputs and a transposed one: the output's
        metadata and the guards are torch's path's; the rule is used on the
        row-major ones where each dimension is given once."""
        used = {}
        for shape, dims, order, dtype in (((2, 5, 16), {0, 1}, (0, 1, 2), torch.float32),
                                          ((2, 3, 4, 5), {0, 2, 3}, (0, 1, 2, 3), torch.float32),
                                          ((2, 5, 16), {0, 1}, (0, 1, 2), torch.bfloat16),
                                          ((2, 5, 16), {0, 1}, (0, 2, 1), torch.float32)):
            n = len(shape)
            reductions = [*itertools.combinations(range(-n, n), 1), (1, 2), (-1, 0), (1, 1 - n)]
            for reduced, keepdim, out_dtype in itertools.product(reductions, (False, True), (None, torch.float64)):
                with self.subTest(shape=shape, order=order, dtype=dtype, dims=reduced, keepdim=keepdim,
                                  out_dtype=out_dtype):
                    outcomes = []
                    for fast in (False, True):
                        x = _symbolic_fake(shape, order, False, dims, dtype)
                        before = len(x.fake_mode.shape_env.guards)
                        dispatched = []
                        args = (x, list(reduced), keepdim, *([{"dtype": out_dtype}] if out_dtype else []))
                        out = _outcome(aten.mean.dim, args, fast, dispatched)
                        outcomes.append((out, _shape_env_after(x.fake_mode, before), dispatched))
                    (torch_way, torch_env, _), (ours, our_env, our_dispatched) = outcomes
                    self.assertEqual((ours, our_env), (torch_way, torch_env))
                    once = len({d % n for d in reduced}) == len(reduced)
                    used.setdefault((order == tuple(range(n)), once), set()).add(not our_dispatched)
        self.assertEqual(used, {(True, True): {True}, (True, False): {False}, (False, True): {False},
                                (False, False): {False}})


def _second_operand(kind, a, shape, dtype):
    """The other operand of a binary op with ``a`` (made of ``shape``, symbolic sizes), in ``a``'s mode."""
    numbers = {"an int": 2, "a float": 0.5, "a bool": True}
    if kind in numbers:
        return numbers[kind]
    if kind == "its sizes' own symbols, another tensor's":
        return _symbolic_fake(shape, tuple(range(a.dim())), False, set(range(a.dim())), dtype, a.fake_mode)
    with a.fake_mode:
        made = {"the same sizes": lambda: torch.empty(a.shape, dtype=dtype),
                "broadcast": lambda: torch.empty(a.shape[-1], dtype=dtype),
                "another dtype": lambda: torch.empty(a.shape, dtype=torch.float64),
                "laid out otherwise": lambda: torch.empty(a.shape, dtype=dtype).transpose(0, 1).contiguous()
                .transpose(0, 1)}
        return made[kind]()


class TestSymbolicBinary(unittest.TestCase):
    def test_each_output_is_torchs(self):
        """add, sub, mul and div at symbolic sizes of a row-major tensor and a
        number, or a tensor of its sizes, dtype and layout (or not: broadcast,
        of another dtype, laid out otherwise, of sizes only equal at run time):
        the output's metadata and the guards are torch's path's; the rule is
        used for the numbers and the tensor alike in all but sizes."""
        ops = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor)
        kinds = ("an int", "a float", "a bool", "the same sizes", "broadcast", "another dtype", "laid out otherwise",
                 "its sizes' own symbols, another tensor's")
        used = {}
        for op, (shape, dims, dtype), kind in itertools.product(
                ops, (((2, 5, 16), {0, 1}, torch.float32), ((2, 5, 16), {0, 1}, torch.bfloat16),
                      ((2, 3, 4, 5), {0, 2}, torch.float32)), kinds):
            with self.subTest(op=op.__name__, shape=shape, dtype=dtype, other=kind):
                outcomes = []
                for fast in (False, True):
                    a = _symbolic_fake(shape, tuple(range(len(shape))), False, dims, dtype)
                    b = _second_operand(kind, a, shape, dtype)
                    before = len(a.fake_mode.shape_env.guards)
                    dispatched = []
                    out = _outcome(op, (a, b), fast, dispatched)
                    outcomes.append((out, _shape_env_after(a.fake_mode, before), dispatched))
                (torch_way, torch_env, _), (ours, our_env, our_dispatched) = outcomes
                self.assertEqual((ours, our_env), (torch_way, torch_env))
                used.setdefault(kind, set()).add(not our_dispatched)
        self.assertEqual({kind for kind, taken in used.items() if taken == {True}},
                         {"an int", "a float", "a bool", "the same sizes"})
        self.assertEqual(set().union(*used.values()), {True, False})


class TestMetaKernels(unittest.TestCase):
    def test_each_op_gives_what_torchs_decomposition_gives(self):
        """Each op in BY_META_KERNEL, across shapes, layouts, dtypes (mixed ones
        too) and arguments: its outputs' sizes, strides, dtypes and devices,
        and the inputs whose memory each shares, are those of torch's fake
        path; and it fails where that fails (sizes that do not fit)."""
        self.assertEqual({op for op, _ in _meta_kernel_cases()}, set(fake_kernels.BY_META_KERNEL))
        failed = 0
        for (op, specs), device in itertools.product(_meta_kernel_cases(), ("cpu", "cuda")):
            if device == "cuda" and not any(isinstance(a, tuple) and a[1:2] == (torch.float32,) for a in specs[:1]):
                continue  # the device crossed with fp32 cases (their first input) alone
            with self.subTest(op=op.__name__, args=specs, device=device):
                mode = FakeTensorMode()
                args = [_made(mode, a, device) if isinstance(a, tuple) and len(a) == 3 and isinstance(a[1], torch.dtype)
                        else a for a in specs]
                ours_dispatched, torch_dispatched = [], []
                ours = _outcome(op, args, True, ours_dispatched)
                torch_way = _outcome(op, args, False, torch_dispatched)
                if torch_way is RuntimeError and device == "cuda" and not torch.backends.cuda.is_built():
                    continue  # torch's decomposition makes a CUDA tensor (``contiguous()``) a CPU build cannot
                self.assertEqual(ours_dispatched, [op])  # its meta kernel, no op of a decomposition
                self.assertGreater(len(torch_dispatched), 1)
                self.assertEqual(ours, torch_way)
                failed += isinstance(ours, type)
        self.assertGreaterEqual(failed, 1)  # the sizes that do not fit (both accept the dtype mixes eager refuses)


class _Stages(torch.nn.Module):
    """Batch norms of several widths, 1-d and 2-d, channels last, with and without affine weights."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        self.stage = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, stride=2), torch.nn.BatchNorm2d(16, affine=False))
        self.head = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 6),
                                        torch.nn.BatchNorm1d(6))

    def forward(self, x):
        return self.head(self.stage(self.stem(x.to(memory_format=torch.channels_last))))


class TestExports(unittest.TestCase):
    def _export(self, model, x, fast: bool, dynamic_shapes=None):  # x: a tensor, or keyword inputs
        """The program, its code, each node's value's metadata (sizes as printed: symbolic ones
        by their expressions) and its range constraints; and the batch norms the rules made."""
        calls = []
        real_kernel = fake_kernels._fast_kernel
        off = {} if fast else {"KERNELS": {}, "BY_META_KERNEL": frozenset()}
        with mock.patch.multiple(fake_kernels, **off) if off else mock.patch.dict({}), \
                mock.patch.object(fake_kernels, "_fast_kernel",
                                  lambda *a: calls.append((a[1], real_kernel(*a))) or calls[-1][1]):
            ep = predispatch.export_predispatch(model, *((x,), {}) if isinstance(x, torch.Tensor) else ((), x),
                                                dynamic_shapes=dynamic_shapes)
        vals = [(n.name, [str(_metadata([v])) for v in (n.meta.get("val"), *(n.meta.get("val") or ()
                 if isinstance(n.meta.get("val"), (tuple, list)) else ())) if isinstance(v, torch.Tensor)])
                for n in ep.graph.nodes]
        self.ruled = {op for op, out in calls if out is not NotImplemented}  # the ops a rule made
        made = sum(out is not NotImplemented for op, out in calls if op in (TRAINING, INFERENCE))  # batch norms
        return ep, (str(ep.graph_module.code), vals, str(ep.range_constraints)), made

    def test_the_program_is_the_one_torchs_path_gives(self):
        """Static, train and eval, fp32 and bf16, and with dynamic shapes: the
        batch alone (every batch norm by rule) or the batch and the image
        height (the 2-d batch norms by torch's path: their strides are
        symbolic, written as its decomposition's ops write them)."""
        batch, height = torch.export.Dim("batch", min=2), torch.export.Dim("height", min=9, max=64)
        dynamics = {"static": (None, 3), "batch": ({0: batch}, 3), "batch and height": ({0: batch, 2: height}, 1)}
        for train, dtype, dynamic in itertools.product((True, False), (torch.float32, torch.bfloat16), dynamics):
            with self.subTest(train=train, dtype=dtype, dynamic=dynamic):
                dims, by_rule = dynamics[dynamic]
                model = _Stages().to(dtype).train(train)
                x = torch.randn(4, 3, 12, 12, dtype=dtype)
                shapes = (dims,) if dims else None
                ep, program, made = self._export(model, x, fast=True, dynamic_shapes=shapes)
                ruled = self.ruled
                _, program_torch, made_torch = self._export(model, x, fast=False, dynamic_shapes=shapes)
                self.assertEqual(program, program_torch)
                self.assertEqual((made, made_torch), (by_rule, 0))
                if dynamic == "batch":  # the stem's ReLU and the head's addmm too (static: addmm's meta kernel)
                    self.assertLessEqual({aten.relu.default, aten.addmm.default}, ruled)
                if dtype is torch.float32 and dynamic != "batch and height":  # the program (its kernels ours) is eager's
                    predispatch.testing.assert_matches_eager(model, (x,), dynamic_shapes=shapes)

    def test_a_language_models_program_is_the_one_torchs_path_gives(self):
        """BERT in fp32, GPT-2 (its Conv1D an addmm, eager attention's softmax)
        under bf16 autocast, each with labels (log_softmax, nll_loss)."""
        transformers = __import__("pytest").importorskip("transformers")
        configs = {
            transformers.BertForMaskedLM: transformers.BertConfig(
                vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
            transformers.GPT2LMHeadModel: transformers.GPT2Config(
                vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0, attn_implementation="eager", use_cache=False),
        }
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        for cls, autocast in ((transformers.BertForMaskedLM, False), (transformers.GPT2LMHeadModel, True)):
            config = configs[cls]
            with self.subTest(model=cls.__name__, autocast=autocast), \
                    torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                torch.manual_seed(0)
                model = cls(config).eval()
                inputs = {"input_ids": ids, "labels": ids}
                met = []

                class Counted(frozenset):
                    def __contains__(self, op):
                        met.append(op) if frozenset.__contains__(self, op) else None
                        return frozenset.__contains__(self, op)

                with mock.patch.object(fake_kernels, "BY_META_KERNEL", Counted(fake_kernels.BY_META_KERNEL)):
                    _, program, _ = self._export(model, inputs, fast=True)
                _, program_torch, _ = self._export(model, inputs, fast=False)
                self.assertEqual(program, program_torch)
                self.assertGreaterEqual(set(met), {aten.addmm.default, aten._log_softmax.default,
                                                   aten.nll_loss_forward.default})  # made by meta kernels


    def test_timm_models_programs_are_the_ones_torchs_path_gives(self):
        """timm's test-sized ResNet, EfficientNet (drop path, squeeze-excite) and
        ConvNeXt (channels-last Linear), train and eval (torch >= 2.14, the vision extra)."""
        timm = __import__("pytest").importorskip("timm")
        x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        for name, train in itertools.product(("test_resnet", "test_efficientnet", "test_convnext"), (True, False)):
            with self.subTest(model=name, train=train):
                torch.manual_seed(0)
                model = timm.create_model(name, pretrained=False, num_classes=10, drop_path_rate=0.1).train(train)
                _, program, made = self._export(model, x, fast=True)
                _, program_torch, _ = self._export(model, x, fast=False)
                self.assertEqual(program, program_torch)
                self.assertEqual(made > 0, name != "test_convnext")  # batch norms by rule (ConvNeXt has none)


if __name__ == "__main__":
    unittest.main()
