"""The Pallas-Triton backend: everything that imports pallas.triton."""
