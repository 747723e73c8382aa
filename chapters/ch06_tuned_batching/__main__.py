from chapters.ch06_tuned_batching.server import main

main()
