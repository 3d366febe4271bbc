"""The Mosaic GPU backend (Hopper): everything that imports
pallas.mosaic_gpu."""
