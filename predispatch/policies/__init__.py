"""What a user decides: which composite ops survive, and the backward's autocast assumption."""
