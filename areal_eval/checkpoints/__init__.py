"""Published checkpoints: saving them durably, the manifest, where they live (local or S3),
publishing from any trainer, retention."""
