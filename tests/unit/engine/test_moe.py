"""engine.models.moe against transformers' own router and expert modules (the
reference): routing is bit-identical in float32, the experts' sum equal to rounding."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds3
from transformers.models.mixtral import modeling_mixtral as mixtral
from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe

from engine.models.moe import SparseMoeBlock, fused_experts, select_experts

H, INTER, T = 32, 24, 37


def _hidden(seed: int = 0) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed))


def _route(router: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        torch.nn.init.normal_(router.weight, 0.0, 0.5, generator=torch.Generator().manual_seed(3))
        _, weights, ids = router(x)
    return weights, ids


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ordered by expert id: the un-sorted top-k may list a token's experts in any
    order, and the experts' sum runs in expert order either way."""
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_softmax_routing_matches_qwen3_moe(norm: bool, top_k: int) -> None:
    cfg = tf.Qwen3MoeConfig(hidden_size=H, num_experts=16, num_experts_per_tok=top_k,
                            norm_topk_prob=norm)
    router = qwen3_moe.Qwen3MoeTopKRouter(cfg)
    x = _hidden()
    want_w, want_ids = _route(router, x)
    got_w, got_ids = select_experts(x @ router.weight.detach().T, top_k, renormalize=norm)
    assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int64
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)


def test_softmax_routing_matches_mixtral() -> None:
    cfg = tf.MixtralConfig(hidden_size=H, num_local_experts=8, num_experts_per_tok=2)
    router = mixtral.MixtralTopKRouter(cfg)
    x = _hidden(1)
    want_w, want_ids = _route(router, x)
    got_w, got_ids = select_experts(x @ router.weight.detach().T, 2, renormalize=True)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_softmax_routing_matches_deepseek_v2(method: str) -> None:
    cfg = tf.DeepseekV2Config(hidden_size=H, n_routed_experts=16, num_experts_per_tok=3,
                              n_group=4, topk_group=2, topk_method=method,
                              routed_scaling_factor=2.5)
    router = ds2.DeepseekV2TopkRouter(cfg)
    x = _hidden(2)
    want_w, want_ids = _route(router, x)
    grouped = method == "group_limited_greedy"
    got_w, got_ids = select_experts(
        x @ router.weight.detach().T, 3, renormalize=False, n_group=4 if grouped else None,
        topk_group=2 if grouped else None, routed_scaling_factor=2.5)
    assert all(torch.equal(a, b) for a, b in zip(_sorted(got_w, got_ids),
                                                   _sorted(want_w, want_ids), strict=True))


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2), (8, 3)])
def test_sigmoid_routing_matches_deepseek_v3(n_group: int, topk_group: int) -> None:
    cfg = tf.DeepseekV3Config(hidden_size=H, n_routed_experts=16, num_experts_per_tok=4,
                              n_group=n_group, topk_group=topk_group, norm_topk_prob=True,
                              routed_scaling_factor=2.5)
    router = ds3.DeepseekV3TopkRouter(cfg)
    bias = torch.randn(16, generator=torch.Generator().manual_seed(5)) * 0.3
    router.e_score_correction_bias.copy_(bias)
    x = _hidden(3)
    want_w, want_ids = _route(router, x)
    got_w, got_ids = select_experts(
        x @ router.weight.detach().T, 4, scoring="sigmoid", renormalize=True,
        e_score_correction_bias=bias, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=2.5)
    assert all(torch.equal(a, b) for a, b in zip(_sorted(got_w, got_ids),
                                                   _sorted(want_w, want_ids), strict=True))
    # The bias changes which experts win but never the weights.
    plain = torch.sigmoid(x @ router.weight.detach().T).gather(1, got_ids)
    torch.testing.assert_close(got_w, plain / plain.sum(-1, keepdim=True) * 2.5)


def test_bad_routing_arguments_are_refused() -> None:
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="scoring"):
        select_experts(logits, 2, scoring="relu", renormalize=True)
    with pytest.raises(ValueError, match="top_k"):
        select_experts(logits, 9, renormalize=True)
    with pytest.raises(ValueError, match="groups"):
        select_experts(logits, 2, scoring="sigmoid", renormalize=True, n_group=3)


def _qwen3_moe_block(top_k: int) -> tuple[torch.nn.Module, SparseMoeBlock]:
    cfg = tf.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=8,
                            num_experts_per_tok=top_k, norm_topk_prob=True)
    ref = qwen3_moe.Qwen3MoeSparseMoeBlock(cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    ours = SparseMoeBlock(H, INTER, 8, top_k, renormalize=True)
    with torch.no_grad():
        ours.gate.weight.copy_(ref.gate.weight)
        ours.w13.copy_(ref.experts.gate_up_proj)
        ours.w2.copy_(ref.experts.down_proj)
    return ref, ours


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_block_matches_transformers(top_k: int) -> None:
    ref, ours = _qwen3_moe_block(top_k)
    x = _hidden(4)
    with torch.no_grad():
        want = ref(x.unsqueeze(0))[0]
        got = ours(x)
    # transformers may run its experts as a grouped matmul: same sums, other rounding.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_experts_reference_is_the_weighted_sum() -> None:
    """The dispatch written as the definition: every (token, slot) pair on its own."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, H, generator=g)
    w13 = torch.randn(6, 2 * INTER, H, generator=g) * 0.2
    w2 = torch.randn(6, H, INTER, generator=g) * 0.2
    ids = torch.tensor([[0, 5], [5, 0], [2, 3], [3, 2], [5, 1]])
    weights = torch.rand(5, 2, generator=g)
    got = fused_experts(x, w13, w2, weights, ids, use_triton=False)
    for t in range(5):
        want = sum(weights[t, k] * (w2[e] @ (torch.nn.functional.silu(w13[e, :INTER] @ x[t])
                                             * (w13[e, INTER:] @ x[t])))
                   for k, e in enumerate(ids[t].tolist()))
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers() -> None:
    from engine.config import ModelConfig, ModelDirError

    base = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    cfg = ModelConfig.from_dict({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert cfg.sparse_layers == (1, 5) and cfg.qk_norm and not cfg.norm_topk_prob
    assert ModelConfig.from_dict({**base, "num_experts": 0}).sparse_layers == ()
    mixtral_cfg = ModelConfig.from_dict({**base, "architectures": ["MixtralForCausalLM"],
                                         "num_local_experts": 4, "num_experts": None})
    assert mixtral_cfg.sparse_layers == tuple(range(6)) and mixtral_cfg.norm_topk_prob
    assert mixtral_cfg.moe_intermediate_size == 64 and mixtral_cfg.num_experts == 4
    with pytest.raises(ModelDirError, match="num_experts_per_tok"):
        ModelConfig.from_dict({**base, "num_experts_per_tok": 9})


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_loader_names_a_missing_or_extra_expert(arch: str, tmp_path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.config import ModelConfig, ModelDirError
    from engine.models.loader import load_model
    from tests.factories import tiny_model_dir

    src = tiny_model_dir(arch)
    cfg = ModelConfig.from_model_dir(src)
    tensors = load_file(f"{src}/model.safetensors")
    model = load_model(src, cfg, torch.float32, torch.device("cpu"))
    mlp = "mlp" if arch == "qwen3_moe" else "block_sparse_moe"
    down = "down_proj" if arch == "qwen3_moe" else "w2"
    up = "up_proj" if arch == "qwen3_moe" else "w3"
    layer = model.model.layers[0].mlp
    e = cfg.num_experts - 1
    inter = cfg.moe_intermediate_size
    assert torch.equal(layer.w13[e, inter:], tensors[f"model.layers.0.{mlp}.experts.{e}.{up}.weight"])
    assert torch.equal(layer.w2[e], tensors[f"model.layers.0.{mlp}.experts.{e}.{down}.weight"])
    d = tmp_path / "m"
    shutil.copytree(src, d)
    key = f"model.layers.0.{mlp}.experts.{e}.{down}.weight"
    save_file({k: v for k, v in tensors.items() if k != key}, f"{d}/model.safetensors")
    with pytest.raises(ModelDirError, match=r"missing.*layers\.0\.mlp\.w2"):
        load_model(str(d), cfg, torch.float32, torch.device("cpu"))
    extra = key.replace(f"experts.{e}.", f"experts.{e + 1}.")
    save_file({**tensors, extra: tensors[key].clone()}, f"{d}/model.safetensors")
    with pytest.raises(ModelDirError, match="unexpected"):
        load_model(str(d), cfg, torch.float32, torch.device("cpu"))


def test_bfloat16_block_matches_transformers_up_to_summation_order() -> None:
    """Qwen3-MoE rounds its routing weights to bf16 before scaling the experts."""
    ref, ours = _qwen3_moe_block(2)
    ref, ours = ref.bfloat16(), ours.bfloat16()
    ours.round_weights = True
    x = _hidden(6).bfloat16()
    with torch.no_grad():
        want = ref(x.unsqueeze(0))[0]
        got = ours(x)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
