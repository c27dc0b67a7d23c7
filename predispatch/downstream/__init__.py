"""What users do with a program next: training, quantization through regions, inlining its regions."""
