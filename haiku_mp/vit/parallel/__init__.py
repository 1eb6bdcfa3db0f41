"""How a step runs on many devices: the `single`, `pmap`, `pjit` and
`fsdp` strategies (`strategies`, by name: `strategy`'s interface,
`replicated` and `sharded`), the mesh and the state's shardings
(`sharding`), and the batch field by which processes agree to stop
(`stop_request`)."""
