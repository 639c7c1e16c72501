"""ssm-compile: a torch.compile backend that makes unmodified Mamba code fast."""
