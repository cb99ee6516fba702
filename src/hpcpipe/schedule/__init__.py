"""Pipeline schedules as data: IR, builders, one registry, lowering, validation, simulation, pictures."""
