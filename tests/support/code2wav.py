"""A small random Qwen3-Omni code2wav (codec codes -> waveform) for the streaming and batching tests."""

from __future__ import annotations

import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav, Qwen3OmniMoeConvNeXtBlock

QUANTIZERS = 16


def small_code2wav(zero_output_bias: bool = False) -> Qwen3OmniMoeCode2Wav:
    """Two layers, width 64, the real conv stack (8,5,4,3)x(2,2) and sliding window 72; seeded."""
    torch.manual_seed(0)
    config = Qwen3OmniMoeCode2WavConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        num_hidden_layers=2,
        decoder_dim=64,
        codebook_size=256,
        num_quantizers=QUANTIZERS,
        sliding_window=72,
        upsample_rates=(8, 5, 4, 3),
        upsampling_ratios=(2, 2),
        layer_scale_initial_scale=0.1,
    )
    model = Qwen3OmniMoeCode2Wav(config).eval()
    with torch.no_grad():
        # At default init the ConvNeXt branches (gamma 1e-6) and the output (~1e-6) are nearly
        # dead, which would let a wrong context or state pass unnoticed: wake them up, then scale
        # the output to an audible level (RMS around -30 dBFS, peaks below the clamp).
        for module in model.modules():
            if isinstance(module, Qwen3OmniMoeConvNeXtBlock):
                module.gamma.fill_(0.5)
        probe = model(torch.randint(0, 256, (1, QUANTIZERS, 20)))
        model.decoder[-1].conv.weight.mul_(0.03 / float(probe.std()))
        if zero_output_bias:
            model.decoder[-1].conv.bias.zero_()
    return model
