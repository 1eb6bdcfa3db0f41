"""The ViT as Haiku modules (`vit`), and as pure functions under a
precision policy (`forward`)."""
