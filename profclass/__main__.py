"""python -m profclass"""
from .cli import main

main()
