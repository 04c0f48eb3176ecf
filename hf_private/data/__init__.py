"""What the sampler draws and how a drawn batch is fed: privacy units, Poisson sampling, users, packing, rows, labels,
local data files."""
