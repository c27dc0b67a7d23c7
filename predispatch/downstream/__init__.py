"""What users do with a program next: training, quantization through regions, region utilities."""
