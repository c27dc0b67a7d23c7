"""The demo: export a real transformers model (a tiny Llama built from a
config, no downloads) wrapped with a no_grad block and an autocast block,
and print the program predispatch makes of it.

    python tools/demo.py            # the normalized program
    python tools/demo.py --torch    # torch's own print of the ExportedProgram
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn

import predispatch
from predispatch.program.printing import format_program


class TokenStatsLlama(nn.Module):
    """A tiny Llama that counts the tokens it sees (under no_grad) and runs
    in bfloat16 autocast."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=32)
        self.llama = LlamaForCausalLM(config)
        self.register_buffer("token_counts", torch.zeros(config.vocab_size))

    def forward(self, input_ids):
        with torch.no_grad():
            self.token_counts.index_add_(0, input_ids.flatten(), torch.ones(input_ids.numel()))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self.llama(input_ids=input_ids, use_cache=False).logits
        return logits.float()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", action="store_true", help="print torch's view of the program")
    opts = parser.parse_args(argv)

    torch.manual_seed(0)
    model = TokenStatsLlama().train()
    input_ids = torch.randint(0, 64, (2, 8))
    start = time.perf_counter()
    ep = predispatch.export_predispatch(model, (input_ids,))
    seconds = time.perf_counter() - start
    print(ep if opts.torch else format_program(ep))

    regions = list(predispatch.regions(ep)) if hasattr(predispatch, "regions") else []
    eager = TokenStatsLlama().train()
    eager.load_state_dict(model.state_dict())
    same = torch.allclose(ep.module()(input_ids), eager(input_ids), atol=1e-2, rtol=1e-2)
    print(f"# exported {type(model.llama).__name__} in {seconds:.2f} s: "
          f"{len(regions)} regions; ep.module() matches eager: {same}")


if __name__ == "__main__":
    main()
