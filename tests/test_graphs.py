"""The key cases of the pipeline, each as its exact normalized graph."""
import torch

import cases
import predispatch
from predispatch.testing import GraphTestCase


class TestGraphs(GraphTestCase):
    def test_seed(self):
        ep = predispatch.export_predispatch(cases.Seed(), (torch.ones(2),))
        self.assertGraphExpectedInline(ep, """\
def forward(x: f32[2]):
    mul = aten.mul.Tensor(x, 1.0)
    no_grad_0 = wrap_with_set_grad_enabled(False, self.no_grad_0, mul)
    getitem = no_grad_0[0]
    keep_history = predispatch.keep_history.default(mul, getitem)
    mul_1 = aten.mul.Tensor(keep_history, keep_history)
    return (mul_1,)
def no_grad_0(mul: f32[2]):
    mul_1 = aten.mul.Tensor(mul, 2)
    return (mul_1,)
inputs:
    x: USER_INPUT
outputs:
    mul_1: USER_OUTPUT
autocast policy: backward_pass_autocast='same_as_forward', on_backward_autocast_mismatch='error'
""")

    def test_input_mutated_through_view_under_no_grad(self):
        ep = predispatch.export_predispatch(cases.InputMutatedThroughView(), (torch.randn(2, 3), torch.randn(2, 3)))
        self.assertGraphExpectedInline(ep, """\
def forward(x: f32[2, 3], y: f32[2, 3]):
    no_grad_0 = wrap_with_set_grad_enabled(False, self.no_grad_0, x)
    getitem = no_grad_0[0]
    keep_history = predispatch.keep_history.default(x, getitem)
    sin = aten.sin.default(keep_history)
    add = aten.add.Tensor(sin, y)
    return (keep_history, add)
def no_grad_0(x: f32[2, 3]):
    select = aten.select.int(x, 0, 0)
    mul = aten.mul.Tensor(select, 3)
    select_scatter = aten.select_scatter.default(x, mul, 0, 0)
    view = aten.view.default(select_scatter, [-1])
    slice = aten.slice.Tensor(view, 0, 1, 3)
    add = aten.add.Tensor(slice, 1)
    view_1 = aten.view.default(select_scatter, [-1])
    slice_scatter = aten.slice_scatter.default(view_1, add, 0, 1, 3)
    view_2 = aten.view.default(slice_scatter, [2, 3])
    return (view_2,)
inputs:
    x: USER_INPUT
    y: USER_INPUT
outputs:
    keep_history: USER_INPUT_MUTATION -> x
    add: USER_OUTPUT
autocast policy: backward_pass_autocast='same_as_forward', on_backward_autocast_mismatch='error'
""")

    def test_ema(self):
        ep = predispatch.export_predispatch(cases.EMA(), (torch.randn(2, 4),))
        self.assertGraphExpectedInline(ep, """\
def forward(p_lin_weight: f32[4, 4], p_lin_bias: f32[4], b_shadow: f32[4, 4], x: f32[2, 4]):
    no_grad_0 = wrap_with_set_grad_enabled(False, self.no_grad_0, b_shadow, p_lin_weight)
    getitem = no_grad_0[0]
    getitem_1 = no_grad_0[1]
    keep_history = predispatch.keep_history.default(p_lin_weight, getitem_1)
    linear = aten.linear.default(x, keep_history, p_lin_bias)
    sum = aten.sum.default(getitem)
    add = aten.add.Tensor(linear, sum)
    return (keep_history, getitem, add)
def no_grad_0(b_shadow: f32[4, 4], p_lin_weight: f32[4, 4]):
    mul = aten.mul.Tensor(b_shadow, 0.9)
    mul_1 = aten.mul.Tensor(p_lin_weight, 0.1)
    add = aten.add.Tensor(mul, mul_1)
    mul_2 = aten.mul.Tensor(p_lin_weight, 0.99)
    return (add, mul_2)
inputs:
    p_lin_weight: PARAMETER -> lin.weight
    p_lin_bias: PARAMETER -> lin.bias
    b_shadow: BUFFER -> shadow
    x: USER_INPUT
outputs:
    keep_history: PARAMETER_MUTATION -> lin.weight
    getitem: BUFFER_MUTATION -> shadow
    add: USER_OUTPUT
autocast policy: backward_pass_autocast='same_as_forward', on_backward_autocast_mismatch='error'
""")

    def test_nested_grad(self):
        ep = predispatch.export_predispatch(cases.NestedGrad(), (torch.randn(3),))
        self.assertGraphExpectedInline(ep, """\
def forward(p_w: f32[3], x: f32[3]):
    mul = aten.mul.Tensor(x, p_w)
    no_grad_0 = wrap_with_set_grad_enabled(False, self.no_grad_0, mul, p_w)
    getitem = no_grad_0[0]
    getitem_1 = no_grad_0[1]
    add = aten.add.Tensor(mul, getitem)
    add_1 = aten.add.Tensor(add, getitem_1)
    return (add_1,)
def no_grad_0(mul: f32[3], p_w: f32[3]):
    mul_1 = aten.mul.Tensor(mul, 2)
    enable_grad_1 = wrap_with_set_grad_enabled(True, self.enable_grad_1, mul, p_w)
    getitem = enable_grad_1[0]
    getitem_1 = enable_grad_1[1]
    add = aten.add.Tensor(mul_1, getitem_1)
    return (getitem, add)
def no_grad_0.enable_grad_1(mul: f32[3], p_w: f32[3]):
    mul_1 = aten.mul.Tensor(mul, p_w)
    no_grad_2 = wrap_with_set_grad_enabled(False, self.no_grad_2, mul_1)
    getitem = no_grad_2[0]
    return (mul_1, getitem)
def no_grad_0.enable_grad_1.no_grad_2(mul_1: f32[3]):
    add = aten.add.Tensor(mul_1, 1)
    mul = aten.mul.Tensor(add, 3)
    return (mul,)
inputs:
    p_w: PARAMETER -> w
    x: USER_INPUT
outputs:
    add_1: USER_OUTPUT
autocast policy: backward_pass_autocast='same_as_forward', on_backward_autocast_mismatch='error'
""")

    def test_no_grad_inside_autocast(self):
        ep = predispatch.export_predispatch(cases.NoGradInsideAutocast(), (torch.randn(2, 4),),
                                            backward_pass_autocast="off",
                                            on_backward_autocast_mismatch="warn")
        self.assertGraphExpectedInline(ep, """\
def forward(p_lin_weight: f32[4, 4], p_lin_bias: f32[4], x: f32[2, 4]):
    autocast_bfloat16_0 = wrap_with_autocast('cpu', torch.bfloat16, True, True, self.autocast_bfloat16_0, x, p_lin_weight, p_lin_bias)
    getitem = autocast_bfloat16_0[0]
    getitem_1 = autocast_bfloat16_0[1]
    _assert_tensor_metadata = aten._assert_tensor_metadata.default(getitem_1, None, None, torch.bfloat16, device=device(type='cpu'), layout=torch.strided)
    _to_copy = aten._to_copy.default(getitem_1, dtype=torch.float32)
    _assert_tensor_metadata_1 = aten._assert_tensor_metadata.default(getitem, None, None, torch.bfloat16, device=device(type='cpu'), layout=torch.strided)
    _to_copy_1 = aten._to_copy.default(getitem, dtype=torch.float32)
    mul = aten.mul.Tensor(_to_copy, _to_copy_1)
    return (mul,)
def autocast_bfloat16_0(x: f32[2, 4], p_lin_weight: f32[4, 4], p_lin_bias: f32[4]):
    no_grad_1 = wrap_with_set_grad_enabled(False, self.no_grad_1, x, p_lin_weight, p_lin_bias)
    getitem = no_grad_1[0]
    linear = aten.linear.default(x, p_lin_weight, p_lin_bias)
    return (getitem, linear)
def autocast_bfloat16_0.no_grad_1(x: f32[2, 4], p_lin_weight: f32[4, 4], p_lin_bias: f32[4]):
    linear = aten.linear.default(x, p_lin_weight, p_lin_bias)
    return (linear,)
inputs:
    p_lin_weight: PARAMETER -> lin.weight
    p_lin_bias: PARAMETER -> lin.bias
    x: USER_INPUT
outputs:
    mul: USER_OUTPUT
autocast policy: backward_pass_autocast='off', on_backward_autocast_mismatch='warn'
""")

    def test_batch_norm_train(self):
        ep = predispatch.export_predispatch(cases.BatchNormNet().train(), (torch.randn(5, 3),))
        self.assertGraphExpectedInline(ep, """\
def forward(p_lin_weight: f32[4, 3], p_lin_bias: f32[4], p_bn_weight: f32[4], p_bn_bias: f32[4], b_bn_running_mean: f32[4], b_bn_running_var: f32[4], b_bn_num_batches_tracked: i64[], x: f32[5, 3]):
    linear = aten.linear.default(x, p_lin_weight, p_lin_bias)
    add = aten.add.Tensor(b_bn_num_batches_tracked, 1)
    _native_batch_norm_legit_functional = aten._native_batch_norm_legit_functional.default(linear, p_bn_weight, p_bn_bias, b_bn_running_mean, b_bn_running_var, True, 0.1, 1e-05)
    getitem = _native_batch_norm_legit_functional[0]
    getitem_1 = _native_batch_norm_legit_functional[3]
    getitem_2 = _native_batch_norm_legit_functional[4]
    relu = aten.relu.default(getitem)
    return (getitem_1, getitem_2, add, relu)
inputs:
    p_lin_weight: PARAMETER -> lin.weight
    p_lin_bias: PARAMETER -> lin.bias
    p_bn_weight: PARAMETER -> bn.weight
    p_bn_bias: PARAMETER -> bn.bias
    b_bn_running_mean: BUFFER -> bn.running_mean
    b_bn_running_var: BUFFER -> bn.running_var
    b_bn_num_batches_tracked: BUFFER -> bn.num_batches_tracked
    x: USER_INPUT
outputs:
    getitem_1: BUFFER_MUTATION -> bn.running_mean
    getitem_2: BUFFER_MUTATION -> bn.running_var
    add: BUFFER_MUTATION -> bn.num_batches_tracked
    relu: USER_OUTPUT
autocast policy: backward_pass_autocast='same_as_forward', on_backward_autocast_mismatch='error'
""")
