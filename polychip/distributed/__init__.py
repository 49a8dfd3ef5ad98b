"""Communication between devices: a thin wrapper over torch.distributed with the plugin's backend."""
