"""The commands: `python -m launch.NAME`. Each starts on glibc's huge pages
unless the user chose an allocator setting (`launch/allocator.py`)."""

from launch import allocator

allocator.use_huge_pages()
