"""A forward that seeds, forks or restores torch's random generator (G5):
the program draws what eager draws and leaves the generator as eager does.

Each module is checked against eager by ``assert_matches_eager`` (outputs,
gradients, buffers, and torch's generator after the call, from the same
seed), and by calls that start from other generator states, through
``torch.export.save`` / ``load`` too."""
import copy
import inspect
import io

import pytest
import torch
import torch.nn.functional as F

import predispatch
from predispatch.testing import GraphTestCase, assert_matches_eager


def freeze_rng_state():
    from torch.testing._internal.common_utils import freeze_rng_state as torch_helper

    return torch_helper()


class SeedsMidForward(torch.nn.Module):
    """A bare ``manual_seed``: the draws before it are the caller's, those
    after it the seed's, and the caller is left with the seed's generator."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        before = torch.rand(4)
        torch.manual_seed(5)
        return F.dropout(self.lin(x), 0.5, training=True) + before + torch.randn(4)


class NoiseInAFork(torch.nn.Module):
    """Fixed noise in a fork; the draws after it continue the caller's."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        first = torch.rand(4)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(7)
            noise = torch.randn(x.shape)
        return self.lin(x + noise) * torch.rand(4) + first


class DrawsInAForkWithoutSeed(torch.nn.Module):
    """A fork's draws are the caller's own; the caller's generator is put back."""

    def forward(self, x):
        with torch.random.fork_rng():  # every device's generator: on a CPU-only torch, none
            inside = torch.rand(x.shape)
        return x * inside + torch.rand(x.shape)  # the same numbers again


class RestoresState(torch.nn.Module):
    def forward(self, x):
        saved = torch.get_rng_state()
        a = torch.rand(x.shape)
        torch.set_rng_state(saved)
        return x * a - torch.rand(x.shape)  # a - b == 0


class DropoutFrozen(torch.nn.Module):
    """op_db's ``wrapper_set_seed``: the op in ``freeze_rng_state()`` after ``manual_seed(42)``."""

    def __init__(self, inplace=False):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.inplace = inplace

    def forward(self, x):
        h = self.lin(x)
        with freeze_rng_state():
            torch.manual_seed(42)
            out = F.dropout(h, 0.5, training=True, inplace=self.inplace)
        return out + F.dropout(h, 0.5, training=True)


class RreluInPlaceFrozen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        with freeze_rng_state():
            torch.manual_seed(42)
            F.rrelu_(h, training=True)
        return h * 2


class DiffusionNoise(torch.nn.Module):
    """Noise from a generator made and seeded in the forward (a sampler's
    ``torch.Generator().manual_seed(s)``): the same noise every call, and the
    caller's generator untouched by it."""

    def __init__(self, seed=1234):
        super().__init__()
        self.denoise = torch.nn.Linear(4, 4)
        self.seed = seed

    def forward(self, x):
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(2):
            noise = torch.randn(x.shape, generator=generator)
            x = x - 0.1 * self.denoise(x + noise)
        kept = torch.empty(x.shape).normal_(generator=generator) > 0  # an in-place draw
        generator.manual_seed(self.seed + 1)  # seeded again between draws
        x = x + torch.rand(x.shape, generator=generator)
        return F.dropout(x, 0.3, training=True) * kept


class ForkInRegions(torch.nn.Module):
    """Seeds and forks inside grad-mode and autocast regions."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(3)
                jitter = torch.randn(x.shape)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.manual_seed(9)
            y = F.dropout(self.lin(x + jitter), 0.2, training=True)
        return y.float() + torch.rand(4)


class SeedFromShape(torch.nn.Module):
    def forward(self, x):
        torch.manual_seed(x.shape[0])
        return x + torch.rand(x.shape[0], 1)


class NoisyLayer(torch.nn.Module):
    def __init__(self, own_generator):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.own_generator = own_generator

    def forward(self, x):
        if self.own_generator:
            return self.lin(x) + torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(2)
            x = F.dropout(self.lin(x), 0.3, training=True)
        return F.dropout(x, 0.1, training=True)


def repeated_layers():
    """Layers traced once and stamped (layer reuse): each seeds and forks,
    or draws from a generator of its own (a state the stamp would not follow)."""
    return torch.nn.Sequential(*[NoisyLayer(own_generator=i % 2 == 1) for i in range(4)])


class DrawsIntoStridedTensors(torch.nn.Module):
    """In-place draws into tensors not laid out contiguously (dropout of a
    transpose fills its mask in memory order; bernoulli_ into a permuted
    view; under no_grad too), and torch.bernoulli out of place, whose result
    eager lays out contiguously."""

    def forward(self, x):
        a = F.dropout(x.t(), 0.5, training=True)
        with torch.no_grad():
            b = torch.empty(2, 3, 4).permute(2, 0, 1).bernoulli_(0.3)
        c = torch.bernoulli(torch.full((4, 3), 0.5).t())
        d = torch.empty(4, 6)[:, ::2].exponential_()
        return a, b, c, d


def dropout_frozen_in_place():
    return DropoutFrozen(inplace=True)


MODULES = [SeedsMidForward, NoiseInAFork, DrawsInAForkWithoutSeed, RestoresState, DropoutFrozen,
           DrawsIntoStridedTensors, dropout_frozen_in_place, RreluInPlaceFrozen, DiffusionNoise, ForkInRegions, repeated_layers]


def _round_trip(ep):
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)


def _assert_calls_match(eager, program, x, seeds=(11, 12)):
    """From each seed: the same output, and the same generator after the call."""
    for seed in seeds:
        torch.manual_seed(seed)
        expected = eager(x)
        expected_state = torch.get_rng_state()
        torch.manual_seed(seed)
        got = program(x)
        expected, got = torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(got)
        assert len(expected) == len(got) and all(map(torch.equal, expected, got)), f"outputs differ from seed {seed}"
        assert torch.equal(expected_state, torch.get_rng_state()), f"generator differs from seed {seed}"


@pytest.mark.parametrize("make", MODULES, ids=lambda m: m.__name__)
def test_matches_eager(make):
    torch.manual_seed(0)
    module = make()
    x = torch.randn(3, 4)
    ep = assert_matches_eager(module, (x,))
    _assert_calls_match(module, ep.module(), x)
    _assert_calls_match(module, _round_trip(ep).module(), x)


@pytest.mark.parametrize("make", [SeedsMidForward, ForkInRegions, DiffusionNoise])
def test_run_decompositions_keeps_the_generator_ops(make):
    """torch's dead-code elimination drops random ops whose result is unused
    while it retraces; a seed or a restore is kept."""
    torch.manual_seed(0)
    module, x = make(), torch.randn(3, 4)
    ep = predispatch.export_predispatch(copy.deepcopy(module), (x,))
    _assert_calls_match(module, ep.run_decompositions().module(), x)


def test_export_leaves_the_callers_generator_alone():
    torch.manual_seed(0)
    module, x = NoiseInAFork(), torch.randn(3, 4)
    before = torch.get_rng_state()
    predispatch.export_predispatch(module, (x,))
    assert torch.equal(before, torch.get_rng_state())


def test_seed_from_a_dynamic_size():
    ep = predispatch.export_predispatch(SeedFromShape(), (torch.randn(3, 4),),
                                        dynamic_shapes=({0: torch.export.Dim("n", min=2)},))
    _assert_calls_match(SeedFromShape(), ep.module(), torch.randn(5, 4))


def test_compile_training_draws_as_eager():
    torch.manual_seed(0)
    module, x = DiffusionNoise(), torch.randn(3, 4)
    train = predispatch.compile_training(predispatch.export_predispatch(copy.deepcopy(module), (x,)))
    for seed in (1, 2):
        runs = []
        for run in (module, train):
            torch.manual_seed(seed)
            xi = x.clone().requires_grad_()
            out = run(xi)
            out.square().sum().backward()
            runs.append((out.detach(), xi.grad, torch.get_rng_state()))
        for eager, program in zip(*runs):
            assert torch.equal(eager, program)


def _op_db_modules():
    """op_db's samples of the ops it wraps in ``freeze_rng_state(); manual_seed(42)``,
    each variant (out-of-place, in-place) as a module."""
    from torch.testing._internal.common_methods_invocations import op_db

    class Variant(torch.nn.Module):
        def __init__(self, fn, args, kwargs):
            super().__init__()
            self.fn, self.args, self.kwargs = fn, args, kwargs

        def forward(self, x):
            return self.fn(x * 1.0, *self.args, **self.kwargs)

    names = ("nn.functional.dropout", "nn.functional.rrelu", "nn.functional.alpha_dropout",
             "nn.functional.dropout2d", "bernoulli", "normal")
    for info in [i for i in op_db if i.name in names and i.variant_test_name == ""]:
        samples = list(info.sample_inputs("cpu", torch.float32, requires_grad=False))[:3]
        for variant, fn in (("", info.op), ("_", info.inplace_variant)):
            for i, sample in enumerate(s for s in samples if fn is not None and s.input.dim() > 0):
                yield pytest.param(Variant(fn, sample.args, sample.kwargs), sample.input,
                                   id=f"{info.name}{variant}-{i}")


@pytest.mark.parametrize("module, x", list(_op_db_modules()))
def test_op_db_seeded_variants(module, x):
    assert_matches_eager(module, (x,), grad_modes=(True,), check_reexport=False)


class SeedsTheDefaultGeneratorObject(torch.nn.Module):
    def forward(self, x):
        torch.default_generator.manual_seed(3)
        return x + torch.rand(3)


def test_a_change_the_trace_cannot_see_is_refused():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with pytest.raises(predispatch.ExportError, match="default_generator"):
        predispatch.export_predispatch(SeedsTheDefaultGeneratorObject(), (torch.ones(3),))
    assert torch.equal(before, torch.get_rng_state())


class SeedReadFromData(torch.nn.Module):
    def forward(self, x):
        torch.manual_seed(x.sum().long())
        return x + torch.rand(3)


class SeedIntOfData(torch.nn.Module):
    def forward(self, x):
        torch.manual_seed(int(x.sum()))
        return x + torch.rand(3)


@pytest.mark.parametrize("module, why, code", [
    (SeedReadFromData(), "the seed is read from a tensor's data", "torch.manual_seed(x.sum().long())"),
    (SeedIntOfData(), "data-dependent", "torch.manual_seed(int(x.sum()))"),
])
def test_seed_from_data_is_refused(module, why, code):
    with pytest.raises(predispatch.ExportError) as info:
        predispatch.export_predispatch(module, (torch.ones(3),))
    src, start = inspect.getsourcelines(type(module).forward)
    line = start + next(i for i, text in enumerate(src) if code in text)
    assert why in str(info.value) and f":{line} " in str(info.value), str(info.value)


class TestGraphs(GraphTestCase):
    def test_seeded_fork(self):
        class M(torch.nn.Module):
            def forward(self, x):
                with freeze_rng_state():
                    torch.manual_seed(42)
                    x = F.dropout(x, 0.5, training=True)
                g = torch.Generator().manual_seed(3)
                return x + torch.rand(x.shape, generator=g)

        ep = predispatch.export_predispatch(M(), (torch.ones(2),))
        self.assertGraphExpectedInline(ep, """\
def forward(x: f32[2]):
    get_rng_state = predispatch.get_rng_state.default(device(type='cpu'))
    manual_seed = predispatch.manual_seed.default(42)
    empty_like = aten.empty_like.default(x)
    detach = aten.detach.default(empty_like)
    bernoulli = aten.bernoulli.p(detach, 0.5)
    div = aten.div.Scalar(bernoulli, 0.5)
    mul = aten.mul.Tensor(x, div)
    set_rng_state = predispatch.set_rng_state.default(get_rng_state, device(type='cpu'))
    get_rng_state_1 = predispatch.get_rng_state.default(device(type='cpu'))
    seed_state = predispatch.seed_state.default(3)
    set_rng_state_1 = predispatch.set_rng_state.default(seed_state, device(type='cpu'))
    rand = aten.rand.default([2], device=device(type='cpu'), pin_memory=False)
    set_rng_state_2 = predispatch.set_rng_state.default(get_rng_state_1, device(type='cpu'))
    add = aten.add.Tensor(mul, rand)
    return (add,)
inputs:
    x: USER_INPUT
outputs:
    add: USER_OUTPUT
autocast policy: backward_pass_autocast='same_as_forward', on_backward_autocast_mismatch='error'
""")


class GeneratorStateReadAndRestored(torch.nn.Module):
    """A generator made in the forward, its state read after a draw and
    restored after another (a sampler that replays its noise): the replayed
    draw is the first one's again, and the state returned is the one after
    it, as eager's."""

    def forward(self, x):
        g = torch.Generator().manual_seed(0)
        first = torch.randn(x.shape, generator=g)
        state = g.get_state()
        second = torch.randn(x.shape, generator=g)
        g.set_state(state)
        again = torch.randn(x.shape, generator=g)
        return x + first + 2 * second + 3 * again + torch.rand(x.shape), g.get_state()


class GeneratorSeededAgainWithItsSeed(torch.nn.Module):
    """Seeded again with the seed it was made with, after a draw: the next
    draw is the first one again (the seed's state, though the generator's
    real state never moved while tracing)."""

    def forward(self, x):
        g = torch.Generator().manual_seed(3)
        first = torch.rand(x.shape, generator=g)
        g.manual_seed(3)
        return x * first + torch.rand(x.shape, generator=g)


def _calls(run, x, seeds=(11, 12)):
    """For each seed of the default generator: the outputs, and that generator after the call."""
    results = []
    for seed in seeds:
        torch.manual_seed(seed)
        results.append((run(x), torch.get_rng_state()))
    return results


@pytest.mark.parametrize("make", [GeneratorStateReadAndRestored, GeneratorSeededAgainWithItsSeed],
                         ids=lambda m: m.__name__)
def test_a_forward_generators_own_state_calls_are_followed(make):
    x = torch.randn(3, 4)
    ep = assert_matches_eager(make(), (x,))
    expected = _calls(make(), x)
    for program in (ep.module(), _round_trip(ep).module()):
        for (want, want_state), (got, got_state) in zip(expected, _calls(program, x)):
            for a, b in zip(_as_tuple(want), _as_tuple(got), strict=True):
                assert torch.equal(a, b)
            assert torch.equal(want_state, got_state)


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


class GeneratorSeededAnew(torch.nn.Module):
    def forward(self, x):
        g = torch.Generator()
        g.seed()
        return x + torch.rand(x.shape, generator=g)


def test_a_forward_generator_seeded_anew_is_refused():
    src, start = inspect.getsourcelines(GeneratorSeededAnew.forward)
    line = start + next(i for i, text in enumerate(src) if "g.seed()" in text)
    with pytest.raises(predispatch.ExportError, match=rf"seed\(\) at .*:{line} "):
        predispatch.export_predispatch(GeneratorSeededAnew(), (torch.ones(3),))


class NoiseFromItsOwnGenerator(torch.nn.Module):
    """A generator made before the export, a module attribute: the program
    draws from that very generator (a constant of the program), as eager
    does; ``torch.export.save`` keeps its state at the save."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.generator = torch.Generator().manual_seed(5)

    def forward(self, x):
        return self.lin(x) + torch.randn(x.shape, generator=self.generator)


def test_a_generator_made_before_the_export_continues_as_eager_and_after_a_load():
    eager, x = NoiseFromItsOwnGenerator(), torch.randn(3, 4)
    program = predispatch.export_predispatch(copy.deepcopy(eager), (x,))
    for _ in range(2):  # each call continues the generator, as each eager call does
        assert torch.equal(eager(x), program.module()(x))
    at_save = copy.deepcopy(eager)  # the generator's state at the save
    loaded = predispatch.load(_saved(program))
    for _ in range(2):
        assert torch.equal(at_save(x), loaded.module()(x))
    assert torch.equal(eager(x), program.module()(x))  # the loaded one drew from its own copy


def _saved(ep) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    return buffer


def test_a_forward_generator_where_real_values_are_propagated():
    """With ``data_dependent="specialize"`` the generator ops' real kernels
    run while tracing; they call torch's own functions, not the trace's
    replacements (which recursed)."""
    x = torch.randn(3, 4)
    ep = predispatch.export_predispatch(GeneratorStateReadAndRestored(), (x,), data_dependent="specialize")
    for (want, want_state), (got, got_state) in zip(_calls(GeneratorStateReadAndRestored(), x),
                                                    _calls(ep.module(), x)):
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        assert torch.equal(want_state, got_state)


class GeneratorWithALargeSeed(torch.nn.Module):
    """A seed beyond a graph's 64-bit signed int (``g.seed()`` draws such):
    the generator's state is held as a constant."""

    def forward(self, x):
        g = torch.Generator().manual_seed(2**64 - 5)
        return x + torch.rand(x.shape, generator=g)


def test_a_forward_generator_with_a_seed_beyond_int64():
    x = torch.randn(3, 4)
    ep = predispatch.export_predispatch(GeneratorWithALargeSeed(), (x,))
    for (want, want_state), (got, got_state) in zip(_calls(GeneratorWithALargeSeed(), x), _calls(ep.module(), x)):
        assert torch.equal(want, got) and torch.equal(want_state, got_state)


class FillsATranspose(torch.nn.Module):
    """An in-place random fill of a transposed 8 x 8 intermediate, seeded:
    eager draws in its memory order, through the kernel for its layout."""

    def __init__(self, fill, kwargs):
        super().__init__()
        self.fill, self.kwargs = fill, kwargs

    def forward(self, x):
        torch.manual_seed(3)
        t = (x * 2).t()
        getattr(t, self.fill)(**self.kwargs)
        return t * 1


@pytest.mark.parametrize("fill, kwargs", [("normal_", {}), ("uniform_", {}), ("exponential_", {}),
                                          ("bernoulli_", {"p": 0.3}), ("log_normal_", {})])
def test_a_fill_of_a_transposed_tensor_draws_as_eager(fill, kwargs):
    """The same numbers at each place and the generator left as eager leaves
    it (normal_ of 16 elements or more draws other numbers into contiguous
    memory than into a transposed layout)."""
    assert_matches_eager(FillsATranspose(fill, kwargs), (torch.randn(8, 8),), inputs_require_grad=False)
