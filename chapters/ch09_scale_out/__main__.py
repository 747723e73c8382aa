from chapters.ch09_scale_out.server import main

main()
