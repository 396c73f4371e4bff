"""The `torch` backend: `torch.utils.data.DataLoader` over the dataset, in its plain and tuned variants."""
