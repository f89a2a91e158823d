"""Native FP8 (128x128 block scales) and FP4 (e2m1, 32-column scales) tensors dequantize on load."""

import os

import torch
from safetensors.torch import load_file, save_file

from dsv4batch.model import Engine
from dsv4batch.model.loader import check_checkpoint
from tests.model_factory import make_hf_checkpoint


def quantize_fp8(w):
    """Independent block quantizer: returns fp8 weight, ue8m0 scale and the exact dequantized value."""
    out, inp = w.shape
    scale = torch.empty((out + 127) // 128, (inp + 127) // 128)
    q = torch.empty_like(w)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            s = 2.0 ** torch.ceil(torch.log2(block.abs().max() / 448))
            scale[i, j] = s
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = block / s
    q8 = q.to(torch.float8_e4m3fn)
    deq = q8.float().clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            deq[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= scale[i, j]
    return q8, scale.to(torch.float8_e8m0fnu), deq


def quantize_fp4(w):
    """e2m1 codes packed two per int8 (low nibble = even column), one ue8m0 scale per 32 columns."""
    lut = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    out, inp = w.shape
    scale = 2.0 ** torch.ceil(torch.log2(w.abs().view(out, inp // 32, 32).amax(-1) / 6))
    x = w / scale.repeat_interleave(32, dim=1)
    k = (x.abs().unsqueeze(-1) - torch.tensor(lut)).abs().argmin(-1)      # nearest magnitude
    codes = (k | ((x < 0).long() << 3)).to(torch.uint8)
    deq = torch.where(x < 0, -1.0, 1.0) * torch.tensor(lut)[k] * scale.repeat_interleave(32, dim=1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu), deq


def test_fp8_and_fp4_tensors_load_dequantized(tmp_path):
    path = str(tmp_path)
    make_hf_checkpoint(path, seed=4, hidden_size=256, q_lora_rank=160)
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    wq, sq, wq_deq = quantize_fp8(state["model.layers.1.attn.wq_a.weight"])  # [160, 256]: partial blocks
    state["model.layers.1.attn.wq_a.weight"], state["model.layers.1.attn.wq_a.scale"] = wq, sq
    w1, s1, w1_deq = quantize_fp4(state["model.layers.2.ffn.experts.3.w1.weight"])  # [32, 256]
    state["model.layers.2.ffn.experts.3.w1.weight"], state["model.layers.2.ffn.experts.3.w1.scale"] = w1, s1
    save_file(state, file)
    check_checkpoint(path)  # a packed FP4 weight's stored shape [32, 128] is not refused
    engine = Engine.from_pretrained(path)
    model = engine.model
    assert torch.equal(model.layers[1].attn.wq_a.weight, wq_deq)
    assert torch.equal(model.layers[2].ffn.experts.w1[3], w1_deq)
    assert torch.isfinite(torch.tensor(engine.score_tokens([[0, 5, 9, 200]])[0])).all()
