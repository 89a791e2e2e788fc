"""Worker-to-worker bulk transfer over NIXL (`agent.TransferAgent`), pulled by one-sided READ."""
