from specframe.cli import main

raise SystemExit(main())
