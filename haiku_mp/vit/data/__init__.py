"""CIFAR-10 in memory and on the device: the sources (`tfds_source`, with
`tfds_download`; `npz_source`; synthetic in `pipeline`), which examples a step reads
(`sampling`), the batches placed on the devices ahead of the loop
(`prefetch`), and the augmentation (`augment`, `auto_augment`,
`image_ops`) and mixing (`mixing`) the step applies."""
