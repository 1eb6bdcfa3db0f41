"""How a step runs on many devices: the `single`, `pmap` and `pjit`
strategies (`strategies`), the mesh and the state's shardings
(`sharding`), and the batch field by which processes agree to stop
(`stop_request`)."""
