"""Few-shot text classification (``task: text``): Hugging Face classifiers meta-trained on episodes."""
