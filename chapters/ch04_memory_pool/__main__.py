from chapters.ch04_memory_pool.server import main

main()
