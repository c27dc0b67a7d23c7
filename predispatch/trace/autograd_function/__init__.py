"""A ``torch.autograd.Function`` called in the forward, captured as one op with its own backward."""
